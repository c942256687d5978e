"""What the native one-row kernel's output rounding costs a row: int8 weights with row scales
(torchao's weight-only scheme, the CPU default) and bfloat16 activations against float32 ones.

Rows of 64 weights, 262,144 of them, so that the per-row work (the product rounded, times the
scale rounded: ``finish`` in ``pipeline/runner/matvec.cpp``) shows against the reads; float32
and bfloat16 alternated every repetition, the best of each. The extra nanoseconds a row times
a model's rows a token (the 254M Llama: about 145,000) is what bfloat16's rounding adds to its
decode step.

    python benchmarks/matvec_rounding.py [--reps 40] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipeline.runner import matvec  # noqa: E402

ROWS, COLUMNS, CALLS = 262_144, 64, 10


def best_us(dtype: torch.dtype, weight: torch.Tensor, scale: torch.Tensor, best: dict) -> None:
    x, s = torch.randn(1, COLUMNS).to(dtype), scale.to(dtype)
    start = time.perf_counter()
    for _ in range(CALLS):
        matvec.run(x, weight, s)
    best[dtype] = min(best.get(dtype, float("inf")), (time.perf_counter() - start) / CALLS * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if (why := matvec.load()) is not None:
        sys.exit(f"matvec_rounding: the native kernel is not available: {why}")
    weight = torch.randint(-127, 128, (ROWS, COLUMNS), dtype=torch.int8)
    scale = torch.rand(ROWS)
    best: dict = {}
    for _ in range(args.reps):
        for dtype in (torch.float32, torch.bfloat16):
            best_us(dtype, weight, scale, best)
    extra_ns = (best[torch.bfloat16] - best[torch.float32]) * 1e3 / ROWS
    print(
        f"{ROWS} rows of {COLUMNS} int8 weights, {torch.get_num_threads()} threads, isa {matvec.isa()}: "
        f"float32 {best[torch.float32]:.0f} us, bfloat16 {best[torch.bfloat16]:.0f} us a call; "
        f"bfloat16 adds {extra_ns:.2f} ns a row"
    )


if __name__ == "__main__":
    main()
