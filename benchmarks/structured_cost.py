"""What constrained decoding costs: R requests, half of them held to a nested JSON schema, against
the same R unconstrained, in one process run; and what compiling a schema costs, once and again.

The workload: R requests (default 64) of random ordinary-vocabulary prompts of 20-90 tokens (new
ones for every run, so no run finds another's prompts in the prefix cache), each
generating G tokens (default 64) greedily with EOS ignored, all submitted at once to one engine
(``max_seqs`` = R). In the mixed run every other request carries ``json_schema=SCHEMA``: an order
with a nested customer and at least 64 line items, so no answer can complete (and stop early)
within G tokens; every request makes exactly G tokens either way and the throughputs compare like
with like. Each repetition runs both, alternating which goes first; throughput = generated tokens /
wall seconds; the ratio is mixed / unconstrained of the medians. The unconstrained requests must
keep their tokens in the mixed run (a constrained neighbour never changes them): checked against
the last mixed run's prompts run again with no constraint.

The grammar's own time on the step comes from ``Engine.stats()``: masking (one bitmask for the
constrained rows, applied in one call) and accepting tokens, per step that had constrained rows.

Compiling: a schema the process has not seen (a fresh variant each repetition) is compiled for the
vocabulary, off the step, once; the second request with the same schema finds it in xgrammar's
cache. Reported: compile seconds, and the time to first token of a lone request that is
unconstrained, constrained by a new schema, and by the same schema again.

The model is the 187M-parameter Llama shape with random weights and a 32,000-token byte-level BPE
vocabulary (``archs.bpe_tokenizer``; the bitmask and the compile grow with the vocabulary, so the
tiny tokenizers would flatter both).

    python benchmarks/structured_cost.py                  # float32, CPU, 64 requests x 64 tokens
    python benchmarks/structured_cost.py --model DIR --requests 32 --json out.json
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


def order_schema(variant: int = 0) -> dict:
    """A nested order; ``variant`` changes an enum so each is a schema the cache has not seen."""
    item = {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
            "gift": {"type": "boolean"},
        },
        "required": ["sku", "qty", "price"],
    }
    customer = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "email": {"type": "string", "format": "email"},
            "tier": {"enum": ["gold", "silver", "bronze", f"v{variant}"]},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "zip": {"type": "string"},
                    "country": {"enum": ["DE", "FR", "CN", "US"]},
                },
                "required": ["street", "country"],
            },
        },
        "required": ["name", "tier", "address"],
    }
    return {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "customer": customer,
                    "items": {"type": "array", "items": item, "minItems": 64},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                },
                "required": ["id", "customer", "items"],
            }
        },
        "required": ["order"],
    }


def prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Random ordinary tokens (no special ones), 20-90 per prompt."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(rng.randint(20, 90))] for _ in range(count)]


def run(pipe, ids: list[list[int]], new_tokens: int, schema: dict | None) -> tuple[float, list, dict]:
    """One batch (every other request constrained when ``schema``): tok/s, results, stats delta."""
    from pipeline import Request

    before = pipe.engine.stats()
    t0 = time.perf_counter()
    handles = [
        pipe.submit(
            Request(max_new_tokens=new_tokens, ignore_eos=True, json_schema=schema if i % 2 == 0 else None), ids=p
        )
        for i, p in enumerate(ids)
    ]
    results = [h.result() for h in handles]
    seconds = time.perf_counter() - t0
    assert all(len(r.token_ids) == new_tokens for r in results), "a request ended early"
    after = pipe.engine.stats()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("steps", "grammar_masks", "grammar_step_s")}
    delta["wall_s"] = seconds
    return sum(len(r.token_ids) for r in results) / seconds, results, delta


def lone_ttft(pipe, ids: list[int], schema: dict | None) -> tuple[float, float]:
    """Time to first token of one request alone, and the compile seconds it caused."""
    from pipeline import Request

    before = pipe.engine.stats().get("grammar_compile_s", 0.0)
    result = pipe.submit(Request(max_new_tokens=2, json_schema=schema), ids=ids).result()
    return result.metrics["ttft_s"], pipe.engine.stats().get("grammar_compile_s", 0.0) - before


def compile_figures(pipe, ids: list[int], reps: int) -> dict:
    """Per repetition: a lone unconstrained request, a new schema, the same schema again."""
    rows = []
    for rep in range(reps):
        schema = order_schema(variant=1000 + rep)
        plain, _ = lone_ttft(pipe, ids, None)
        first, compile_s = lone_ttft(pipe, ids, schema)
        again, again_s = lone_ttft(pipe, ids, schema)
        rows.append((plain, first, compile_s, again, again_s))
        print(
            f"rep {rep} ttft plain {plain * 1e3:.1f} ms, new schema {first * 1e3:.1f} ms "
            f"(compile {compile_s * 1e3:.1f} ms), again {again * 1e3:.1f} ms (compile {again_s * 1e3:.2f} ms)",
            file=sys.stderr,
        )
    med = [statistics.median(column) for column in zip(*rows)]
    return {
        "ttft_unconstrained_ms": round(med[0] * 1e3, 1),
        "ttft_new_schema_ms": round(med[1] * 1e3, 1),
        "compile_new_schema_ms": round(med[2] * 1e3, 1),
        "ttft_same_schema_again_ms": round(med[3] * 1e3, 1),
        "compile_same_schema_again_ms": round(med[4] * 1e3, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        help="a save_pretrained directory (default: the 187M-parameter Llama, random "
        "weights, 32,000-token BPE vocabulary)",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--burst", type=int, default=8, help="engine.burst (1: no decode bursts for either run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    from pipeline import Pipeline, load_model
    from stages import DecodeLoop, Prefill

    path = args.model or str(build_llama_187m(Path(tempfile.gettempdir()) / "mm-bench-llama-187m-bpe", tokenizer="bpe"))
    lm = load_model(path, dtype=getattr(torch, args.dtype))
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, max_seqs=args.requests, burst=args.burst)
    fresh = iter(range(args.seed, args.seed + 10_000))  # new prompts for every run: no prefix-cache hits
    ids = prompts(lm.tokenizer, args.requests, next(fresh))
    t0 = time.perf_counter()
    run(pipe, ids[:4], 4, order_schema())  # warm-up: xgrammar's import and vocabulary, the schema, kernels
    warm_s, first_compile_s = time.perf_counter() - t0, pipe.engine.stats()["grammar_compile_s"]
    rates: dict[str, list[float]] = {"unconstrained": [], "half_constrained": []}
    grammar: list[dict] = []
    for rep in range(args.reps):
        for name in rates if rep % 2 == 0 else list(rates)[::-1]:
            ids = prompts(lm.tokenizer, args.requests, next(fresh))
            rate, results, delta = run(pipe, ids, args.new_tokens, order_schema() if name != "unconstrained" else None)
            rates[name].append(rate)
            if name != "unconstrained":
                mixed, grammar = (ids, [r.token_ids for r in results]), grammar + [delta]
            print(f"rep {rep} {name}: {rate:.1f} tok/s", file=sys.stderr)
    _, alone, _ = run(pipe, mixed[0], args.new_tokens, None)  # the mixed run's prompts, none constrained
    per_step = [d["grammar_step_s"] / d["grammar_masks"] for d in grammar]
    figures = {
        "model": path,
        "dtype": args.dtype,
        "vocab_size": len(lm.tokenizer),
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "burst": args.burst,
        "threads": torch.get_num_threads(),
        "tok_s": {k: round(statistics.median(v), 1) for k, v in rates.items()},
        "ratio_half_constrained": round(
            statistics.median(rates["half_constrained"]) / statistics.median(rates["unconstrained"]), 3
        ),
        "grammar_ms_per_step": round(statistics.median(per_step) * 1e3, 2),
        "grammar_share_of_wall": round(statistics.median(d["grammar_step_s"] / d["wall_s"] for d in grammar), 3),
        "steps_with_constrained_rows": grammar[-1]["grammar_masks"],
        "steps": grammar[-1]["steps"],
        "unconstrained_tokens_kept": all(mixed[1][i] == alone[i].token_ids for i in range(1, len(ids), 2)),
        "first_compile_ms": round(first_compile_s * 1e3, 1),  # includes reading the vocabulary, once per engine
        "first_constrained_batch_s": round(warm_s, 2),
        **compile_figures(pipe, ids[0], args.reps),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
