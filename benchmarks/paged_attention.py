"""One attention layer over the paged pool: FlexAttention in place against SDPA over gathered keys,
and on CPU the native decode kernel (``decode_attention.cpp``).

What ``kv.attention`` chooses between (``pipeline.runner.flex``), measured in one run on the same
pool, rows and scattered block tables, one layer of Qwen2-VL-2B's attention shape by default (12
query heads, 2 key/value heads, head size 128): decode rows (one query each: a lone stream, then
batches) and, on CUDA, one prefill chunk over cached keys. Every path is exact (the largest
difference from the gathered path is printed); the figures are the ratios of their times to it.

    python benchmarks/paged_attention.py                       # CPU
    python benchmarks/paged_attention.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.runner import flex, matvec  # noqa: E402
from pipeline.kv.quantised import LayerKV  # noqa: E402
from pipeline.runner.paged_batch import key_slots  # noqa: E402


def timed(fn, reps: int, device: torch.device) -> float:
    """Best of ``reps`` seconds (after one warm call)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def case(rows: int, context: int, queries: int, args: argparse.Namespace) -> dict:
    device, dtype, size = torch.device(args.device), getattr(torch, args.dtype), args.block_size
    gen = torch.Generator().manual_seed(0)
    k_pool = torch.randn(args.pool_blocks * size, args.kv_heads, args.head_dim, generator=gen).to(device, dtype)
    v_pool = torch.randn(args.pool_blocks * size, args.kv_heads, args.head_dim, generator=gen).to(device, dtype)
    blocks = -(-context // size)
    tables = (torch.randperm(args.pool_blocks - 1, generator=gen)[: rows * blocks] + 1).view(rows, blocks).to(device)
    qpos = torch.arange(context - queries, context, device=device).expand(rows, queries)
    hi = qpos + 1
    q = torch.randn(rows, args.heads, queries, args.head_dim, generator=gen).to(device, dtype)
    pool = SimpleNamespace(num_blocks=args.pool_blocks, expose=lambda blocks: None)  # every block written (randn)
    extent = flex.extent_blocks(pool, tables.tolist(), device)

    def in_place() -> torch.Tensor:
        masks = flex.paged_masks(tables, hi, qpos, size, extent, None)
        return flex.attend(q, k_pool, v_pool, masks, False, None, size)

    def gathered() -> torch.Tensor:
        slots = key_slots(tables, size)
        ks, vs = LayerKV(k_pool, v_pool).gather(slots, dtype)
        mask = (torch.arange(slots.shape[1], device=device) < hi.unsqueeze(-1)).unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, enable_gqa=True)

    def native() -> torch.Tensor:  # [rows, heads, dim] as [rows, heads, 1, dim]
        slots = key_slots(tables, size)
        mask = torch.arange(slots.shape[1], device=device) < hi
        return torch.ops.mm_pipeline.decode_attention(
            q[:, :, 0], k_pool, v_pool, slots, mask, args.head_dim**-0.5
        ).unsqueeze(2)

    reference = gathered().float()
    g, f, diff = timed(gathered, args.reps, device), float("nan"), float("nan")
    if flex.KERNEL.broken is None:
        try:
            diff = (in_place().float() - reference).abs().max().item()
            f = timed(in_place, args.reps, device)
        except Exception as err:  # Inductor cannot build it for this shape: said once, as in the engine
            flex.KERNEL.fail(err)
    out = dict(
        rows=rows, context=context, queries=queries, flex_ms=f * 1e3, gather_ms=g * 1e3, ratio=g / f, max_diff=diff
    )
    if queries == 1 and device.type == "cpu" and matvec.load() is None:
        out.update(
            native_ms=timed(native, args.reps, device) * 1e3,
            native_diff=(native().float() - reference).abs().max().item(),
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    shapes = [(1, 300, 1), (1, 2000, 1), (8, 1000, 1), (64, 512, 1), (64, 2000, 1)]  # one stream, then batches
    if args.device.startswith("cuda"):
        shapes += [(1, 12288, 4096)]
    print(
        f"{args.device} {args.dtype}, {args.heads}/{args.kv_heads} heads x {args.head_dim}, "
        f"blocks of {args.block_size}, pool of {args.pool_blocks} blocks"
    )
    for rows, context, queries in shapes:
        r = case(rows, context, queries, args)
        native = (
            f"  native {r['native_ms']:8.2f} ms {r['gather_ms'] / r['native_ms']:.2f}x "
            f"(max diff {r['native_diff']:.1e})"
            if "native_ms" in r
            else ""
        )
        print(
            f"rows {rows:3d} x {queries:4d} queries, context {context:5d}: gather+SDPA {r['gather_ms']:8.2f} ms  "
            f"flex {r['flex_ms']:8.2f} ms {r['ratio']:.2f}x (max diff {r['max_diff']:.1e}){native}",
            flush=True,
        )
    if flex.KERNEL.broken:
        print(f"note: {flex.KERNEL.broken}")


if __name__ == "__main__":
    main()
