"""What asking for log-probabilities costs decode: the same batch of requests with and without
``Request(logprobs=K)``, in one process run.

The workload: R requests (default 32) of random ordinary-vocabulary prompts of 20-90 tokens,
each generating G tokens (default 64) greedily with EOS ignored, all submitted at once to one
engine (``max_seqs`` = R). Each repetition runs the plain batch and each ``--logprobs`` setting in
alternating order; throughput = generated tokens / wall seconds, and the cost is 1 - (with /
without) of the medians. The tokens must be identical (asking never changes the choice).

    python benchmarks/logprobs_cost.py                          # the 187M-parameter Llama shape, float32, CPU
    python benchmarks/logprobs_cost.py --model DIR --logprobs 1,20
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from archs import build_llama_187m  # noqa: E402


def prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Random ordinary tokens (no special ones), 20-90 per prompt."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(rng.randint(20, 90))] for _ in range(count)]


def run(pipe, ids: list[list[int]], new_tokens: int, logprobs: int | None) -> tuple[float, list[list[int]]]:
    from pipeline import Request

    t0 = time.perf_counter()
    handles = [pipe.submit(Request(max_new_tokens=new_tokens, ignore_eos=True, logprobs=logprobs), ids=p) for p in ids]
    results = [h.result() for h in handles]
    seconds = time.perf_counter() - t0
    if logprobs is not None:
        assert all(len(r.logprobs) == new_tokens and len(r.logprobs[0].top) == logprobs for r in results)
    return sum(len(r.token_ids) for r in results) / seconds, [r.token_ids for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a save_pretrained directory (default: the 187M-parameter Llama, random weights)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--logprobs", default="1,5", help="top alternatives asked for, one run each")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    from pipeline import Pipeline, load_model
    from stages import DecodeLoop, Prefill

    dtype = getattr(torch, args.dtype)
    path = args.model or str(build_llama_187m(Path(tempfile.gettempdir()) / "mm-bench-llama-187m"))
    lm = load_model(path, dtype=dtype)
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, max_seqs=args.requests)
    ids = prompts(lm.tokenizer, args.requests, args.seed)
    settings = [None] + [int(k) for k in args.logprobs.split(",")]
    run(pipe, ids[:4], 4, None)  # warm-up: first-call allocations and kernel choices
    rates: dict[str, list[float]] = {str(k): [] for k in settings}
    tokens: dict[str, list[list[int]]] = {}
    for rep in range(args.reps):
        for k in settings if rep % 2 == 0 else settings[::-1]:
            rate, tokens[str(k)] = run(pipe, ids, args.new_tokens, k)
            rates[str(k)].append(rate)
            print(f"rep {rep} logprobs={k}: {rate:.1f} tok/s", file=sys.stderr)
    base = statistics.median(rates["None"])
    figures = {
        "model": path,
        "dtype": args.dtype,
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "tok_s": {k: round(statistics.median(v), 1) for k, v in rates.items()},
        "cost": {k: round(1 - statistics.median(v) / base, 3) for k, v in rates.items() if k != "None"},
        "tokens_identical": all(t == tokens["None"] for t in tokens.values()),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
