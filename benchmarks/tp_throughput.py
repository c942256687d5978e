"""Tensor parallel against one process: the engine_throughput workload (R requests of 20-90 random
tokens, G greedy tokens each, EOS ignored, all submitted at once) at ``model.tp=N``.

Run it once in one process and once under torchrun on the same cores; the second run reads the
first's figures (``--against``) and prints both with their ratio, whether every request's tokens
are identical, the KV capacity the same ``--kv-memory`` gives each rank, each rank's weight bytes,
and the share of step time the collectives take (``torch.profiler`` on rank 0: gloo's all-reduce
and all-gather, and the waits on them).

    python benchmarks/tp_throughput.py --json /tmp/tp1.json
    torchrun --nproc-per-node 2 benchmarks/tp_throughput.py --json /tmp/tp2.json --against /tmp/tp1.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from archs import build_arch  # noqa: E402
from engine_throughput import run_engine, workload, workload_args  # noqa: E402

from pipeline import Pipeline, follow, load_model  # noqa: E402
from pipeline.model import tensor_parallel
from stages import DecodeLoop, Prefill  # noqa: E402

COLLECTIVES = ("allreduce", "all_reduce", "allgather", "all_gather", "wait_tensor", "broadcast")


def collective_share(pipe: Pipeline, prompts: list[list[int]], gen: int) -> float:
    """Share of a profiled run's wall time spent in collectives (rank 0's view)."""
    from torch.profiler import profile

    with profile() as prof:
        seconds, _, _ = run_engine(pipe, prompts, gen, at_once=True)
    spent = sum(e.self_cpu_time_total for e in prof.key_averages() if any(c in e.key.lower() for c in COLLECTIVES))
    return spent / 1e6 / seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="llama-187m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    workload_args(ap)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kv-memory", type=int, default=256 << 20, help="kv.memory in bytes, on each rank")
    ap.add_argument("--json", type=Path, help="write this run's figures and tokens here")
    ap.add_argument("--against", type=Path, help="a one-process run's --json, printed beside this one")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "mm-pipeline-bench")
    args = ap.parse_args(argv)
    tp = tensor_parallel.launched_size()
    rank = int(os.environ.get("RANK", "0"))
    built = [str(build_arch(args.arch, args.cache_dir, "cpu", getattr(torch, args.dtype))) if rank == 0 else None]
    if tp > 1:
        tensor_parallel.start(tp)
        torch.distributed.broadcast_object_list(built, src=0)  # rank 0 built (or found) the model folder
    lm = load_model(built[0], dtype=args.dtype, tp=tp)
    if rank > 0:
        follow(lm)
        return 0
    pipe = Pipeline(
        lm,
        {"prefill": Prefill(), "decode": DecodeLoop()},
        max_seqs=args.requests,
        max_batch_tokens=2048,
        kv_memory=args.kv_memory,
    )
    prompts = workload(lm, args)
    run_engine(pipe, prompts[:4], 4, at_once=True)  # warm
    times, tokens = [], None
    for _ in range(args.reps):
        seconds, tokens, _ = run_engine(pipe, prompts, args.new_tokens, at_once=True)
        times.append(seconds)
    share = collective_share(pipe, prompts, args.new_tokens) if tp > 1 else 0.0
    generated = args.requests * args.new_tokens
    figures = {
        "tp": tp,
        "tok_s": generated / min(times),
        "capacity_tokens": pipe.pool.capacity_tokens,
        "kv_bytes_per_token": pipe.pool.block_bytes // pipe.pool.block_size,
        "weights_bytes": lm.weights_bytes,
        "collective_share": share,
        "threads": torch.get_num_threads(),
        "tokens": tokens,
    }
    tensor_parallel.finish()
    if args.json:
        args.json.write_text(json.dumps(figures))
    rows = [json.loads(args.against.read_text())] if args.against else []
    print(f"{args.arch} {args.dtype}, {args.requests} requests x {args.new_tokens} tokens, best of {args.reps}")
    print(
        "| model.tp | threads a rank | tok/s | vs tp=1 | KV tokens a rank holds | KV bytes/token a rank "
        "| weights a rank | collectives |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base = rows[0]["tok_s"] if rows else figures["tok_s"]
    for f in rows + [figures]:
        print(
            f"| {f['tp']} | {f['threads']} | {f['tok_s']:.1f} | {f['tok_s'] / base:.2f}x | {f['capacity_tokens']:,} | "
            f"{f['kv_bytes_per_token']:,} | {f['weights_bytes'] / 2**20:.0f} MiB | {f['collective_share']:.0%} |"
        )
    if rows:
        same = sum(a == b for a, b in zip(rows[0]["tokens"], tokens))
        print(f"tokens identical to the one-process run: {same}/{len(tokens)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
