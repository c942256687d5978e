"""The native one-row kernel (``pipeline/runner/matvec.cpp``) on each instruction set this CPU has,
against PyTorch's ``F.linear`` and a bare read, on the 187M-parameter Llama's 57 matrices.

One token through every matrix of the shape (hidden 1024, 8 layers, intermediate 4096, 4 KV
heads, vocabulary 32,000), random weights, in float32, bfloat16 and torchao-style int8 with one
scale per row (bfloat16 activations); each path timed over all matrices in turn, paths alternated
every repetition, medians and maxima of GB/s of weights read. What the kernel's instruction-set
choice (``matvec.isa``) and its prefetch distance were decided on. (No roofline row: PyTorch's own
streaming reductions read slower than these products; ``decode_vs_generate.copy_gb_s`` and a
hand-written read loop are the references in benchmarks/README.md.)

    python benchmarks/matvec_kernels.py [--reps 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipeline.runner import matvec  # noqa: E402


def llama_187m_shapes() -> list[tuple[int, int]]:
    """(out, in) of every linear layer a decode step runs, in order, output projection last."""
    layer = [(1024, 1024), (256, 1024), (256, 1024), (1024, 1024), (4096, 1024), (4096, 1024), (1024, 4096)]
    return layer * 8 + [(32000, 1024)]


def isas() -> list[str]:
    default, found = matvec.isa(), []
    for name in ("avx2", "avx512"):
        try:
            found.append(matvec.isa(name))
        except RuntimeError:
            pass
    matvec.isa(default)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    why_not = matvec.load()
    if why_not is not None:
        print(f"skipped: the native kernel is unavailable here ({why_not})", file=sys.stderr)
        return 0
    torch.manual_seed(0)
    shapes = llama_187m_shapes()
    weights = {dt: [torch.randn(n, k, dtype=dt) for n, k in shapes] for dt in (torch.float32, torch.bfloat16)}
    int8 = [
        (torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, dtype=torch.bfloat16) / 64)
        for n, k in shapes
    ]
    xs = {dt: {k: torch.randn(1, k, dtype=dt) for k in (1024, 4096)} for dt in (torch.float32, torch.bfloat16)}
    nbytes = {
        "float32": sum(w.numel() * 4 for w in weights[torch.float32]),
        "bfloat16": sum(w.numel() * 2 for w in weights[torch.bfloat16]),
        "int8": sum(q.numel() for q, _ in int8),
    }

    def over(items: list, call: Callable) -> Callable[[], None]:
        return lambda: [call(item) for item in items]

    paths: dict[tuple[str, str], tuple[str | None, Callable[[], None]]] = {}
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        x = xs[dtype]
        paths[(name, "F.linear")] = (None, over(weights[dtype], lambda w, x=x: F.linear(x[w.shape[1]], w)))
        for isa in isas():
            paths[(name, f"kernel {isa}")] = (isa, over(weights[dtype], lambda w, x=x: matvec.run(x[w.shape[1]], w)))
    x = xs[torch.bfloat16]
    for isa in isas():
        paths[("int8", f"kernel {isa}")] = (
            isa,
            over(int8, lambda qs, x=x: matvec.run(x[qs[0].shape[1]], qs[0], qs[1])),
        )

    default = matvec.isa()
    speeds: dict[tuple[str, str], list[float]] = {key: [] for key in paths}
    for rep in range(args.reps + 1):
        for key in paths if rep % 2 == 0 else reversed(list(paths)):
            isa, run = paths[key]
            matvec.isa(isa or default)
            t0 = time.perf_counter()
            run()
            if rep:  # the first round warms caches and allocators
                speeds[key].append(nbytes[key[0]] / (time.perf_counter() - t0) / 1e9)
    matvec.isa(default)
    print(
        f"{torch.get_num_threads()} threads, {args.reps} reps, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"kernel default {default}; GB/s of weights, the 187M Llama's 57 matrices"
    )
    print("| weights | path | median GB/s | max GB/s | vs F.linear |")
    print("|---|---|---|---|---|")
    for (dtype, path), values in speeds.items():
        base = speeds.get((dtype, "F.linear"))
        ratio = f"{statistics.median(values) / statistics.median(base):.2f}x" if base else "-"
        print(f"| {dtype} | {path} | {statistics.median(values):.1f} | {max(values):.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
