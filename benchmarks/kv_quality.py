"""What a quantised KV cache (``kv.dtype``) costs in quality: next-token distributions read
through the engine's paged pool, against the same model with full-precision keys and values.

Teacher-forced *decoding*: each sequence's first tokens are the prompt, then a sampler hands the
engine the reference tokens one step at a time and keeps the distribution the step produced, so
every distribution comes from attention over the stored (quantised) keys, as real decoding reads
them. Two models, float32 weights (only the KV storage differs between runs):

- the copy-trained tiny Qwen3 (``scripts.train.train_copy``) on its held-out passages, forced over
  the answers; and, free-running greedy, the share of answers it gets exactly right and of
  answers whose tokens equal the full-precision run's;
- the 187M-parameter Llama shape (random weights, ``archs``) on random ordinary-vocabulary
  sequences: a 32-token prompt, the rest forced.

Per ``kv.dtype``, against ``auto`` at the same positions: mean KL(auto || kv) of the next-token
distribution, top-1 agreement (also over the positions whose reference top two are more than
0.01 nats apart: a random-weight model's distribution is nearly flat, and most of its flips are
near-ties), perplexity of the reference tokens and its ratio to ``auto``.

    python benchmarks/kv_quality.py                         # auto, int8, fp8; both models
    python benchmarks/kv_quality.py --sequences 4 --skip-random
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from archs import build_arch  # noqa: E402
from pipeline import Pipeline, Request, load_model  # noqa: E402
from stages import DecodeLoop, Prefill  # noqa: E402


CLEAR = 0.01  # nats between the reference's top two: above it a flipped argmax is not a near-tie


class Forced:
    """A sampler that answers with the reference tokens and keeps each step's log-distribution."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.logps = tokens, []

    def fork(self) -> "Forced":
        return self

    def __call__(self, logits: torch.Tensor, previous_ids: object = None) -> torch.Tensor:
        self.logps.append(F.log_softmax(logits[-1].float(), -1))
        return torch.tensor([self.tokens[len(self.logps) - 1]], device=logits.device)


def pipe_for(lm: object, kv_dtype: str, rows: int) -> Pipeline:
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_dtype=kv_dtype, max_seqs=rows)
    pipe.pool.clear_prefix_cache()
    return pipe


def forced(lm: object, kv_dtype: str, seqs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Per (prompt, continuation): [len(continuation), vocab] log-distributions, all run at once."""
    pipe = pipe_for(lm, kv_dtype, len(seqs))
    samplers = [Forced(cont) for _, cont in seqs]
    handles = [
        pipe.submit(Request(max_new_tokens=len(cont), ignore_eos=True, sampler=s), ids=prompt, result=False)
        for (prompt, cont), s in zip(seqs, samplers)
    ]
    for h in handles:
        pipe.wait(h).cache.clear()
    return [torch.stack(s.logps) for s in samplers]


def compare(lm: object, kinds: list[str], seqs: list[tuple[list[int], list[int]]]) -> dict[str, dict]:
    """KL against the first kind, top-1 agreement, perplexity of the forced tokens."""
    targets = torch.cat([torch.tensor(cont) for _, cont in seqs])
    runs = {k: torch.cat(forced(lm, k, seqs)) for k in kinds}
    ref = runs[kinds[0]]
    top2 = ref.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > CLEAR  # positions whose reference top-1 is not a near-tie
    out = {}
    for kind, lp in runs.items():
        nll = -float(lp.gather(1, targets[:, None]).mean())
        agree = lp.argmax(-1) == ref.argmax(-1)
        out[kind] = {
            "kl": float((ref.exp() * (ref - lp)).sum(-1).mean()),
            "top1": float(agree.float().mean()),
            "top1_clear": float(agree[clear].float().mean()),
            "clear": float(clear.float().mean()),
            "ppl": math.exp(nll),
            "positions": len(targets),
        }
    for f in out.values():
        f["ppl_ratio"] = f["ppl"] / out[kinds[0]]["ppl"]
    return out


def greedy(lm: object, kinds: list[str], seqs: list[tuple[list[int], list[int]]]) -> dict[str, dict]:
    """Free-running greedy answers: exactly right, and identical to the first kind's."""
    answers = {}
    for kind in kinds:
        pipe = pipe_for(lm, kind, len(seqs))
        handles = [pipe.submit(Request(max_new_tokens=len(ans) + 4), ids=prompt, result=False) for prompt, ans in seqs]
        answers[kind] = [list(pipe.wait(h).generated) for h in handles]
    ref = answers[kinds[0]]
    return {
        k: {
            "exact": sum(a[: len(s[1])] == s[1] for a, s in zip(got, seqs)) / len(seqs),
            "same": sum(a == r for a, r in zip(got, ref)) / len(seqs),
        }
        for k, got in answers.items()
    }


def copy_sequences(lm: object, n: int) -> list[tuple[list[int], list[int]]]:
    from scripts.train.train_copy import TASKS, Task, heldout

    maker = Task(lm.tokenizer)
    return [(maker.prompt_ids(e), maker.answer_ids(e)) for task in TASKS for e in heldout(lm.tokenizer, n, task)]


def random_sequences(lm: object, n: int, length: int, prompt: int = 32) -> list[tuple[list[int], list[int]]]:
    special = set(lm.tokenizer.all_special_ids) | set(lm.tokenizer.get_added_vocab().values())
    vocab = torch.tensor([i for i in range(len(lm.tokenizer)) if i not in special])
    g = torch.Generator().manual_seed(0)
    ids = [vocab[torch.randint(len(vocab), (length,), generator=g)].tolist() for _ in range(n)]
    return [(s[:prompt], s[prompt:]) for s in ids]


def report(title: str, figures: dict[str, dict], exact: dict[str, dict] | None = None) -> None:
    print(f"\n{title}")
    extra = " | greedy answers exact | same as auto" if exact else ""
    clear = next(iter(figures.values()))["clear"]
    print(
        f"| kv.dtype | KL(auto ‖ kv) | top-1 agreement | where auto's top two differ by > {CLEAR} nats "
        f"({100 * clear:.0f}% of positions) | perplexity | vs auto{extra} |"
    )
    print("|---|---|---|---|---|---|" + ("---|---|" if exact else ""))
    for kind, f in figures.items():
        tail = f" | {exact[kind]['exact']:.2f} | {exact[kind]['same']:.2f}" if exact else ""
        print(
            f"| {kind} | {f['kl']:.2e} | {100 * f['top1']:.2f}% | {100 * f['top1_clear']:.2f}% | {f['ppl']:.3f} | "
            f"{f['ppl_ratio']:.4f}x{tail} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--kinds", default="auto,int8,fp8", help="comma-separated kv.dtype values; the first is the reference"
    )
    ap.add_argument("--sequences", type=int, default=16, help="held-out passages per task / random sequences")
    ap.add_argument("--length", type=int, default=256, help="tokens per random sequence (187M model)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-random", action="store_true", help="only the trained model")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "mm-pipeline-bench")
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)

    from scripts.train.train_copy import copy_models

    target = copy_models(progress=True)[0]
    lm = load_model(str(target), dtype=dtype)
    seqs = copy_sequences(lm, args.sequences)
    report(
        f"copy-trained Qwen3 target ({target.name}), {args.dtype}, {len(seqs)} held-out passages, answers forced",
        compare(lm, kinds, seqs),
        greedy(lm, kinds, seqs),
    )
    if not args.skip_random:
        lm = load_model(str(build_arch("llama-187m", args.cache_dir, "cpu", dtype)), dtype=dtype)
        seqs = random_sequences(lm, args.sequences, args.length)
        report(
            f"llama-187m (random weights), {args.dtype}, {args.sequences} random sequences of {args.length} "
            f"tokens (32 prompt, the rest forced)",
            compare(lm, kinds, seqs),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
