"""``mode=eval``'s model (``pipeline.frontends.evaluation.EngineLM``) against lm-eval's own ``hf`` model
(``HFLM``) on one multiple-choice task, in one process: the same weights, documents and lm-eval.

The task (generated, local): Q questions (default 200) of 4 choices each; every question is a
passage of about ``--context`` tokens followed by a question, and each choice a few words (a
reading-comprehension task: RACE, SciQ with its support passage, or few-shot prompts). lm-eval
turns it into 4 x Q loglikelihood requests.

HFLM runs at its best batch size: each of ``--hf-batch`` is tried on the first ``--probe``
questions and the fastest is used for the whole task. Both runs are timed around
``simple_evaluate`` (wall seconds). Checked: the same accuracy, and every choice's
log-likelihood within ``--tolerance`` (float32 weights: both sum log_softmax over the same logits).

    python benchmarks/eval_vs_hflm.py                      # the 187M-parameter Llama shape, random weights, CPU
    python benchmarks/eval_vs_hflm.py --questions 20 --hf-batch 8   # a quick check
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from archs import build_llama_187m  # noqa: E402

WORDS = (
    "harbour boat market bread fish morning noon square people river bridge stone tower bell garden "
    "window road north south winter summer rain wind hill field farmer horse cart lamp school teacher "
    "child letter story music song dance city village forest path mountain valley lake island ship"
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def write_task(folder: Path, questions: int, context_tokens: int, tokenizer, seed: int) -> None:
    """The task's YAML and its documents: a passage near ``context_tokens`` tokens, a question,
    four choices of 2-6 words."""
    rng = random.Random(seed)
    with open(folder / "docs.jsonl", "w") as f:
        for _ in range(questions):
            passage = ""
            while len(tokenizer(passage)["input_ids"]) < context_tokens:
                passage += sentence(rng, rng.randint(6, 14)) + " "
            choices = [" " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))) for _ in range(4)]
            doc = {
                "question": f"{passage}Question: what does the passage say?\nAnswer:",
                "choices": choices,
                "answer": rng.randrange(4),
            }
            f.write(json.dumps(doc) + "\n")
    (folder / "bench_mc.yaml").write_text(
        f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )


def timed(model, manager, limit: int | None) -> tuple[float, dict]:
    from lm_eval import simple_evaluate

    t0 = time.perf_counter()
    out = simple_evaluate(
        model=model, tasks=["bench_mc"], task_manager=manager, limit=limit, log_samples=True, verbosity="ERROR"
    )
    return time.perf_counter() - t0, out


def choice_scores(out: dict) -> list[float]:
    samples = sorted(out["samples"]["bench_mc"], key=lambda s: s["doc_id"])
    return [r[0][0] for s in samples for r in s["resps"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a save_pretrained directory (default: the 187M-parameter Llama, random weights)")
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--context", type=int, default=250, help="tokens of each question's passage")
    ap.add_argument("--hf-batch", default="8,32", help="HFLM batch sizes to try")
    ap.add_argument("--probe", type=int, default=25, help="questions each HFLM batch size is tried on")
    ap.add_argument("--max-seqs", type=int, default=None, help="engine.max_seqs (default: mode=eval's)")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from pipeline import Pipeline, load_model
    from pipeline.frontends.evaluation import EngineLM
    from stages import DecodeLoop, Prefill

    work = Path(tempfile.mkdtemp(prefix="eval-bench-"))
    path = args.model or str(build_llama_187m(Path(tempfile.gettempdir()) / "mm-bench-llama-187m"))
    lm = load_model(path, dtype=torch.float32)
    write_task(work, args.questions, args.context, lm.tokenizer, args.seed)
    manager = TaskManager(include_path=str(work))
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, max_seqs=args.max_seqs)

    probes = {}
    for size in (int(b) for b in args.hf_batch.split(",")):
        probes[size] = timed(HFLM(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=size), manager, args.probe)[0]
        print(f"HFLM batch {size}: {probes[size]:.1f} s on {args.probe} questions", file=sys.stderr)
    best = min(probes, key=probes.get)
    hf_s, theirs = timed(HFLM(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=best), manager, None)
    ours_s, ours = timed(EngineLM(pipe), manager, None)

    mine, ref = choice_scores(ours), choice_scores(theirs)
    worst = max(abs(a - b) for a, b in zip(mine, ref))
    acc = (ours["results"]["bench_mc"]["acc,none"], theirs["results"]["bench_mc"]["acc,none"])
    figures = {
        "model": path,
        "questions": args.questions,
        "choices": len(mine),
        "context_tokens": args.context,
        "threads": torch.get_num_threads(),
        "hflm_batch_probes_s": probes,
        "hflm_batch": best,
        "hflm_s": round(hf_s, 2),
        "engine_s": round(ours_s, 2),
        "speedup": round(hf_s / ours_s, 2),
        "accuracy_engine": acc[0],
        "accuracy_hflm": acc[1],
        "max_abs_loglikelihood_diff": worst,
        "engine_tokens_in": pipe.engine.counters["tokens_in"],
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    if acc[0] != acc[1] or worst > args.tolerance:
        sys.exit(f"mismatch: accuracy {acc}, largest log-likelihood difference {worst:.2e}")


if __name__ == "__main__":
    main()
