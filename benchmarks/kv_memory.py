"""What ``kv.dtype`` and ``kv.offload`` buy and cost, on the 187M-parameter Llama shape (random
weights, ``archs``), each ratio against a baseline measured in the same run:

- capacity: tokens, and sequences of ``--seq-tokens``, that one ``--memory`` holds per kv.dtype;
- speed: ``engine_throughput``'s batch (64 random prompts of 20-90 tokens, 48 new tokens each,
  all at once) per kv.dtype, repetitions alternated; tokens compared with ``auto``'s;
- offload: a ``--doc-tokens`` shared document is asked about, pushed out of a pool too small to
  keep it beside other work, and asked about again (a new question): time to first token when
  the pool recomputes it, when a disk tier (``kv.offload=disk``) loads it back, and when a pool
  large enough kept it (a prefix-cache hit); the tier's answers must equal the hit's (exact
  bytes), a recompute's may differ in bfloat16 (its own rounding).

    python benchmarks/kv_memory.py                          # all three, bfloat16
    python benchmarks/kv_memory.py --only offload --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from archs import build_arch  # noqa: E402
from engine_throughput import run_engine, workload, workload_args  # noqa: E402
from pipeline import Pipeline, Request, load_model  # noqa: E402
from pipeline.memory import fmt_bytes, kv_bytes  # noqa: E402
from stages import DecodeLoop, Prefill  # noqa: E402

KINDS = ("auto", "int8", "fp8")


def capacity(lm: object, args: argparse.Namespace) -> None:
    print(f"\ncapacity: kv.memory={fmt_bytes(args.memory)}, {args.dtype}")
    print(f"| kv.dtype | bytes a token | tokens | sequences of {args.seq_tokens} | vs auto |")
    print("|---|---|---|---|---|")
    base = None
    for kind in KINDS:
        pool = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=args.memory, kv_dtype=kind).pool
        seqs = (pool.num_blocks - 1) // -(-args.seq_tokens // pool.block_size)
        base = base or seqs
        print(
            f"| {kind} | {pool.block_bytes // pool.block_size:,} | {pool.capacity_tokens:,} | {seqs:,} | "
            f"{seqs / base:.2f}x |"
        )


def speed(lm: object, args: argparse.Namespace) -> None:
    prompts = workload(lm, args)
    kinds = args.kinds.split(",")
    pipes = {
        k: Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_dtype=k, max_seqs=len(prompts))
        for k in kinds
    }
    for pipe in pipes.values():
        run_engine(pipe, prompts[:4], 4, at_once=True)  # warm
    times: dict[str, list[float]] = {k: [] for k in kinds}
    tokens = {}
    for rep in range(args.reps):
        for kind in kinds if rep % 2 == 0 else reversed(kinds):
            seconds, tokens[kind], _ = run_engine(pipes[kind], prompts, args.new_tokens, at_once=True)
            times[kind].append(seconds)
    generated = len(prompts) * args.new_tokens
    base = generated / statistics.median(times["auto"])
    print(
        f"\nspeed: {len(prompts)} requests at once, {args.new_tokens} new tokens each, {args.dtype}, median of "
        f"{args.reps}"
    )
    print("| kv.dtype | tok/s | vs auto | each repetition's ratio, lowest-highest | sequences identical to auto |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        rate = generated / statistics.median(times[kind])
        paired = [a / k for a, k in zip(times["auto"], times[kind])]
        same = sum(a == b for a, b in zip(tokens[kind], tokens["auto"]))
        print(
            f"| {kind} | {rate:.1f} | {rate / base:.2f}x | {min(paired):.2f}-{max(paired):.2f} | "
            f"{same}/{len(prompts)} |"
        )


def offload(lm: object, args: argparse.Namespace) -> None:
    vocab = [i for i in range(len(lm.tokenizer)) if i not in set(lm.tokenizer.all_special_ids)]
    g = torch.Generator().manual_seed(1)
    pick = lambda n: [vocab[i] for i in torch.randint(len(vocab), (n,), generator=g).tolist()]  # noqa: E731
    doc, filler = pick(args.doc_tokens), [pick(args.doc_tokens) for _ in range(2)]
    memory = (args.doc_tokens * 3 // 2) * kv_bytes(lm.config, 1, lm.model.dtype)  # one document and a half
    folder = tempfile.mkdtemp(prefix="kv-tier-")
    stages = lambda: {"prefill": Prefill(), "decode": DecodeLoop()}  # noqa: E731
    pipes = {
        "recompute": Pipeline(lm, stages(), kv_memory=memory, max_seqs=1),
        "disk tier": Pipeline(lm, stages(), kv_memory=memory, max_seqs=1, kv_offload="disk", kv_offload_dir=folder),
        "prefix cache (a pool that keeps it)": Pipeline(lm, stages(), kv_memory=4 * memory, max_seqs=1),
    }
    ttft: dict[str, list[float]] = {k: [] for k in pipes}
    answers = {}
    for rep in range(args.reps):
        for name, pipe in pipes.items():
            ask = lambda ids: pipe.run_ids(ids, Request(max_new_tokens=8, ignore_eos=True))  # noqa: E731
            ask(doc + pick(12)).cache.clear()
            for other in filler:  # the document's blocks leave the pool
                ask(other).cache.clear()
            ctx = ask(doc + [vocab[rep]] * 12)
            ttft[name].append(ctx.metrics.to_dict()["ttft_s"])
            answers.setdefault(rep, {})[name] = list(ctx.generated)
            ctx.cache.clear()
    stats = pipes["disk tier"].engine.stats()
    base = statistics.median(ttft["recompute"])
    print(
        f"\noffload: a {args.doc_tokens}-token document pushed out of a {fmt_bytes(memory)} pool and asked about "
        f"again, {args.dtype}, median of {args.reps}"
    )
    print("| second ask | TTFT | vs recompute |")
    print("|---|---|---|")
    for name, values in ttft.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.1f} ms | {statistics.median(values) / base:.3f}x |")
    kept = all(a["disk tier"] == a["prefix cache (a pool that keeps it)"] for a in answers.values())
    same = sum(a["recompute"] == a["disk tier"] for a in answers.values())
    print(
        f"answers: the tier's identical to a prefix-cache hit's: {kept}; to a recompute's in {same} of {len(answers)} "
        f"(a {args.dtype} prefill of the document alone and with the question round differently)"
    )
    print(
        f"tier: {stats['kv_tier_hits']} blocks loaded, "
        f"{fmt_bytes(stats['kv_tier_bytes_loaded'])} in {stats['kv_tier_load_s'] * 1e3:.1f} ms, "
        f"{stats['kv_tier_blocks']} blocks held ({fmt_bytes(stats['kv_tier_bytes'])})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["capacity", "speed", "offload"], help="one part (default: all three)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--memory", type=int, default=256 << 20, help="capacity: kv.memory in bytes")
    ap.add_argument("--seq-tokens", type=int, default=640, help="capacity: tokens a sequence holds")
    ap.add_argument("--doc-tokens", type=int, default=2000, help="offload: the shared document's tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS), help="speed: the kv.dtype values timed (auto first)")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "mm-pipeline-bench")
    workload_args(ap)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    lm = load_model(str(build_arch("llama-187m", args.cache_dir, "cpu", dtype)), dtype=dtype)
    print(f"llama-187m (random weights), {torch.get_num_threads()} threads")
    for part in (capacity, speed, offload):
        if args.only in (None, part.__name__):
            part(lm, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
