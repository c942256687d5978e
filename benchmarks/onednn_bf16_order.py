"""In what order oneDNN's bfloat16 matmul sums one row's products on this CPU: why the engine's
bfloat16 answers can part from ``generate()``'s at near ties (docs/engine.md, "Exactness").

``torch.mm`` of one bfloat16 row by a [K, N] bfloat16 matrix (what ``generate()`` runs for every
linear layer of a bfloat16 model, torchao's int8 weights widened first) is compared, bit for
bit, with float32 sums taken in a few orders, each rounded once to bfloat16:

- ``columns``: one float32 sum in column order;
- ``amx``: the AMX tile instruction's order (Intel SDM, TDPBF16PS): every 32 columns summed as two
  chains of 16, the even columns and the odd ones, the two added, those added in column order;
- ``amx, K in B blocks``: the same over each of B equal blocks of columns, the blocks' sums added.

Inputs of a wide range (normal values times e^(2 normal)) and whole-number weights, as int8 ones
widened, make the orders differ in a few outputs in ten thousand. Printed: the outputs (of N)
where each order's bits differ from oneDNN's. On a 2-core AMX Xeon with torch 2.11 (oneDNN
3.10.2): ``amx`` matches at K 1,280 and 2,560 (N 32,768, no output differing); at K 3,456 it
differs in 2 and two blocks match. How many blocks oneDNN splits the columns into comes from its
blocking heuristic (``brgemm_matmul_utils.cpp``: a function of N, K, the thread count and the
caches); blocks are ceil(steps / blocks) 32-column steps each, the last one shorter. The engine's
kernel finds the count per weight shape when it loads a model (``matvec.onednn_blocks``, the same
kind of inputs as here but cancelling, so that about one output in ten tells orders apart).

    python benchmarks/onednn_bf16_order.py [--n 32768] [--k 1280 3456] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch


def amx_chunks(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """Per 32 columns, the float32 sum of each output's products in the tile instruction's order."""
    sums = []
    for start in range(0, x.numel(), 32):
        even, odd = torch.zeros(w.shape[0]), torch.zeros(w.shape[0])
        for k in range(start, start + 32, 2):
            even = even + x[k] * w[:, k]
            odd = odd + x[k + 1] * w[:, k + 1]
        sums.append(even + odd)
    return sums


def in_blocks(chunks: list[torch.Tensor], blocks: int) -> torch.Tensor:
    """The chunks' sums added in order within each of ``blocks`` equal blocks, then the blocks'."""
    per = -(-len(chunks) // blocks)
    total = None
    for b in range(0, len(chunks), per):
        block = chunks[b]
        for c in chunks[b + 1 : b + per]:
            block = block + c
        total = block if total is None else total + block
    return total


def columns(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(w.shape[0])
    for k in range(x.numel()):
        total = total + x[k] * w[:, k]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768, help="outputs (the matrix's rows)")
    ap.add_argument("--k", type=int, nargs="+", default=[1280, 2560, 3456], help="columns, multiples of 32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for k in args.k:
        x = (torch.randn(1, k) * torch.exp(2 * torch.randn(1, k))).to(torch.bfloat16)
        w = torch.randint(-127, 128, (args.n, k)).to(torch.bfloat16)
        onednn = torch.mm(x, w.t())[0]
        xf, wf = x.float()[0], w.float()
        chunks = amx_chunks(xf, wf)
        orders = {"columns": columns(xf, wf)} | {
            ("amx" if b == 1 else f"amx, K in {b} blocks"): in_blocks(chunks, b) for b in (1, 2, 3, 4)
        }
        differ = {name: int((total.to(torch.bfloat16) != onednn).sum()) for name, total in orders.items()}
        print(f"N {args.n}, K {k}, {torch.get_num_threads()} threads: outputs differing from oneDNN's: {differ}")


if __name__ == "__main__":
    main()
