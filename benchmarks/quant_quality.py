"""What a weight scheme costs in quality: next-token distributions against the unquantised model.

Two models, each loaded once per scheme (float32 activations, so only the weights differ):

- the copy-trained tiny Qwen3 (``scripts.train.train_copy``, 1024 wide: its matrices are the
  size the native kernel reads), on its held-out passages: teacher-forced over the answers, and
  the share of answers greedy decoding gets exactly right (``train_copy.evaluate``);
- the 187M-parameter Llama shape (random weights, ``archs``), on random ordinary-vocabulary
  sequences: teacher-forced over every position.

Per scheme, against ``none`` at the same positions: the mean KL divergence KL(none || scheme) of
the next-token distribution, top-1 agreement (argmaxes equal), and perplexity of the reference
tokens (the answers; for the random model the sequence itself) with its ratio to ``none``.

    python benchmarks/quant_quality.py                                  # none, int8wo-keephead, int8wo
    python benchmarks/quant_quality.py --schemes none,int8wo --sequences 4

Scheme names are ``quant_speed.py``'s: ``int8wo-keephead`` is int8wo with
``quant.skip_modules=[lm_head]`` (the output projection kept in model.dtype, transformers' default).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from archs import build_arch  # noqa: E402
from quant_speed import load  # noqa: E402


def compare(models: dict[str, object], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, dict]:
    """Per scheme: mean KL against the first scheme, top-1 agreement, perplexity, over the positions
    each batch's mask selects (``ids`` [1, L], ``mask`` [L - 1]: which next tokens count)."""
    names = list(models)
    sums = {n: {"kl": 0.0, "agree": 0, "nll": 0.0} for n in names}
    count = 0
    for ids, mask in batches:
        logps = {}
        for name, lm in models.items():
            with torch.inference_mode():
                logits = lm.model(input_ids=ids).logits[0, :-1][mask].float()
            logps[name] = F.log_softmax(logits, -1)
        ref = logps[names[0]]
        targets = ids[0, 1:][mask]
        for name in names:
            lp = logps[name]
            sums[name]["kl"] += float((ref.exp() * (ref - lp)).sum())
            sums[name]["agree"] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            sums[name]["nll"] -= float(lp.gather(1, targets[:, None]).sum())
        count += int(mask.sum())
    base_ppl = torch.exp(torch.tensor(sums[names[0]]["nll"] / count)).item()
    return {
        n: {
            "kl": s["kl"] / count,
            "top1": s["agree"] / count,
            "ppl": torch.exp(torch.tensor(s["nll"] / count)).item(),
            "ppl_ratio": torch.exp(torch.tensor(s["nll"] / count)).item() / base_ppl,
            "positions": count,
        }
        for n, s in sums.items()
    }


def copy_batches(lm: object, n: int) -> tuple[list, object]:
    """The copy model's held-out passages: (prompt + answer ids, mask over the answer's positions)."""
    from scripts.train.train_copy import TASKS, Task, heldout

    maker = Task(lm.tokenizer)
    batches = []
    for task in TASKS:
        for example in heldout(lm.tokenizer, n, task):
            prompt, answer = maker.prompt_ids(example), maker.answer_ids(example)
            ids = torch.tensor([prompt + answer])
            mask = torch.zeros(ids.shape[1] - 1, dtype=torch.bool)
            mask[len(prompt) - 1 :] = True
            batches.append((ids, mask))
    return batches, maker


def random_batches(lm: object, n: int, length: int) -> list:
    special = set(lm.tokenizer.all_special_ids) | set(lm.tokenizer.get_added_vocab().values())
    pool = torch.tensor([i for i in range(len(lm.tokenizer)) if i not in special])
    g = torch.Generator().manual_seed(0)
    return [
        (pool[torch.randint(len(pool), (1, length), generator=g)], torch.ones(length - 1, dtype=torch.bool))
        for _ in range(n)
    ]


def report(title: str, figures: dict[str, dict], exact: dict[str, dict] | None = None) -> None:
    print(f"\n{title}")
    extra = " | copy exact / translate exact" if exact else ""
    print(f"| scheme | KL(none ‖ scheme) | top-1 agreement | perplexity | vs none{extra} |")
    print("|---|---|---|---|---|" + ("---|" if exact else ""))
    for name, f in figures.items():
        tail = f" | {exact[name]['repeat']['exact']:.2f} / {exact[name]['translate']['exact']:.2f}" if exact else ""
        print(f"| {name} | {f['kl']:.2e} | {100 * f['top1']:.2f}% | {f['ppl']:.3f} | {f['ppl_ratio']:.4f}x{tail} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--schemes", default="none,int8wo-keephead,int8wo", help="comma-separated; the first is the reference"
    )
    ap.add_argument("--sequences", type=int, default=16, help="held-out passages per task / random sequences")
    ap.add_argument("--length", type=int, default=256, help="tokens per random sequence (187M model)")
    ap.add_argument("--copy-model", help="the copy target's directory (default: trained once into the cache)")
    ap.add_argument("--skip-random", action="store_true", help="only the trained model")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "mm-pipeline-bench")
    args = ap.parse_args(argv)
    schemes = [s for s in args.schemes.split(",") if s]
    torch.manual_seed(0)

    from scripts.train.train_copy import copy_models, evaluate

    target = Path(args.copy_model) if args.copy_model else copy_models(progress=True)[0]
    models = {s: load(target, s, "float32") for s in schemes}
    batches, _ = copy_batches(models[schemes[0]], args.sequences)
    exact = {s: evaluate(lm.model, lm.tokenizer, args.sequences) for s, lm in models.items()}
    report(
        f"copy-trained Qwen3 target ({target.name}), float32, {args.sequences} held-out passages a task, "
        f"answers teacher-forced",
        compare(models, batches),
        exact,
    )
    if not args.skip_random:
        model_dir = build_arch("llama-187m", args.cache_dir, "cpu", torch.float32)
        models = {s: load(model_dir, s, "float32") for s in schemes}
        batches = random_batches(models[schemes[0]], args.sequences, args.length)
        report(
            f"llama-187m (random weights), float32, {args.sequences} random sequences of {args.length} tokens",
            compare(models, batches),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
