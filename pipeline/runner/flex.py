"""FlexAttention over the paged pool: attention reads every row's keys where they lie.

One layer's keys are one pool tensor [slots, kv_heads, D]; seen as [1, kv_heads, slots, D] it is
FlexAttention's key tensor, shared by every row of the batch (batch dimension 1, broadcast). A
block mask lists, per row and query block, the pool blocks it visits (its own, from its block
table; one pool block is one KV block of the mask), and the mask function keeps, inside them,
the keys the query may see: ``lo <= position < hi``, with ``hi`` the first key it may not see
(causal, the end of a bidirectional media block it lies in, the row's length) and ``lo`` the
first key its sliding window still sees (0 without one). A key's position in its sequence is
found through ``logical`` (pool block -> its index in the tables holding it): a block has the
same index in every table that shares it, since the prefix cache and forks share whole aligned
prefixes only. Nothing is gathered and no [queries, keys] mask is built; the compiled kernel
(Triton on CUDA, a C++ template on CPU) reads only the listed blocks.

This is the shape of torch's own ``torch.nn.attention.experimental._paged_attention``, with the
page table applied when the mask is built instead of kept as a second table.

Where it runs (``BlockPool.attention``, ``kv.attention``): ``auto`` (the default) on CUDA, decode
rows and prefill chunks; ``flex`` on any device; ``sdpa`` nowhere. Why ``auto`` keeps CPU on SDPA
over gathered keys, measured with torch 2.11 on 2 cores: its C++ FlexAttention template reads a
decode batch faster (64 rows x 2k context, 12/2 heads: 67 ms against 126 ms) but miscompiles under
dynamic shapes once a graph has enough size symbols (``cpp_flex_attention_template.py`` renames
its split-size symbol by plain text replacement: "cur_kvSplitSize8 was not declared"), and a
4,096-token prefill chunk over 12k keys took 5.5 s against SDPA's 2.3 s.
"""

from __future__ import annotations

import sys
import traceback
import types
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from pipeline.runner.masks import window_start

Q_BLOCK = 128  # query rows per block of the mask (CUDA's decoding kernel needs a multiple of its 16-row tiles)
FLEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FlexFallback(UserWarning):
    """FlexAttention could not run here: attention gathers each row's keys instead (same values)."""


warnings.filterwarnings("ignore", category=FlexFallback, append=True)  # shown once as one line instead


@dataclass
class PagedMasks:
    """A group's FlexAttention masks and what a fallback needs to rebuild them as tensors.

    ``tables`` [B, W] block tables (padded with the null block), ``hi`` [B, L] the first key
    position each query may not see, ``lo`` [B, L] the first its sliding window sees (None:
    no window), ``extent`` pool slots the key tensors cover (every listed block lies below)."""

    tables: torch.Tensor
    hi: torch.Tensor
    lo: torch.Tensor | None
    extent: int
    full: BlockMask
    window: BlockMask | None


def usable(pool: Any, device: torch.device) -> bool:
    """Whether decode rows read this pool through FlexAttention (``kv.attention``)."""
    wanted = pool.attention == "flex" or (pool.attention == "auto" and device.type == "cuda")
    # A quantised pool (kv.dtype) is dequantised as it is gathered: FlexAttention reads it in place.
    return wanted and pool.dtype in FLEX_DTYPES and pool.format is None and KERNEL.broken is None


def usable_for_prefill(pool: Any, device: torch.device) -> bool:
    """Prefill chunks too: on CUDA (its Triton kernel), or where the kernel runs unfused (tests)."""
    return usable(pool, device) and (device.type == "cuda" or KERNEL.unfused)


def extent_blocks(pool: Any, tables: list[list[int]], device: torch.device) -> int:
    """How many pool blocks the key tensors cover. On CUDA the whole pool (one shape for every
    step, so CUDA graphs stay few; the mask's per-row index rows are pool-wide, cheap there).
    On CPU the blocks up to the highest one the batch names, rounded up to a power of two: a
    mostly idle pool costs nothing per step. Blocks in it never written yet are zeroed first
    (``BlockPool.expose``): uninitialised memory can hold NaN, and a masked key's weight of 0
    times NaN is NaN."""
    if device.type == "cuda":
        extent = pool.num_blocks
    else:
        top = max((max(t) for t in tables if t), default=0) + 1
        extent = min(pool.num_blocks, max(2, 1 << (top - 1).bit_length()))
    pool.expose(extent)
    return extent


def paged_masks(
    tables: torch.Tensor, hi: torch.Tensor, qpos: torch.Tensor | None, block_size: int, extent: int, window: int | None
) -> PagedMasks:
    """The masks of rows with block ``tables`` [B, W], queries seeing keys below ``hi`` [B, L];
    with a sliding ``window`` a second mask for the sliding layers, from ``qpos`` [B, L] (the
    queries' positions: ``masks.window_start``)."""
    hi = hi.to(torch.int32)
    lo = None if window is None else window_start(qpos, window).to(torch.int32)
    logical = torch.zeros(extent, dtype=torch.int32, device=tables.device)
    rows, width = tables.shape
    logical.scatter_(0, tables.reshape(-1), torch.arange(width, dtype=torch.int32, device=tables.device).repeat(rows))
    full = _block_mask(tables, hi, None, logical, block_size, extent)
    slide = None if lo is None else _block_mask(tables, hi, lo, logical, block_size, extent)
    return PagedMasks(tables, hi, lo, extent * block_size, full, slide)


def _block_mask(
    tables: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor | None, logical: torch.Tensor, block_size: int, extent: int
) -> BlockMask:
    """Per query block, the pool blocks from the one holding its lowest ``lo`` to the one holding
    its highest ``hi``; inside them the mask function keeps ``lo <= position < hi``."""
    rows, width = tables.shape
    length = hi.shape[1]
    blocks = -(-length // Q_BLOCK)
    top = _per_query_block(hi, blocks, torch.amax)
    first = torch.zeros_like(top) if lo is None else _per_query_block(lo, blocks, torch.amin) // block_size
    count = (top + block_size - 1) // block_size - first  # [B, blocks]
    picks = (first.unsqueeze(-1) + torch.arange(width, device=tables.device)).clamp(max=width - 1)
    listed = tables.unsqueeze(1).expand(rows, blocks, width).gather(2, picks.long()).to(torch.int32)
    # FlexAttention wants an index row as wide as the key tensor's blocks; past ``count`` it is never read.
    indices = torch.cat([listed, listed.new_zeros(rows, blocks, extent)], dim=2).unsqueeze(1)
    owned = torch.zeros(rows, extent, dtype=torch.bool, device=tables.device).scatter_(1, tables, True)
    owned[:, 0].fill_(False)  # the null block (table padding) is never seen (fill_: no host scalar tensor)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        block = kv // block_size
        index = logical[block]
        position = index * block_size + kv % block_size
        # Exact on its own (a block of another row is refused), as the unfused path needs:
        # the kernel visits listed blocks only, but eager FlexAttention applies this everywhere.
        seen = owned[b, block] & (position < hi[b, q])
        return seen if lo is None else seen & (position >= lo[b, q])

    return BlockMask.from_kv_blocks(
        count.to(torch.int32).unsqueeze(1),
        indices,
        BLOCK_SIZE=(Q_BLOCK, block_size),
        mask_mod=mask_mod,
        seq_lengths=(length, extent * block_size),
        compute_q_blocks=False,
    )


def _per_query_block(values: torch.Tensor, blocks: int, reduce: Any) -> torch.Tensor:
    """[B, L] -> [B, blocks]: ``reduce`` over each run of ``Q_BLOCK`` queries (the last run padded
    with its last query)."""
    rows, length = values.shape
    pad = blocks * Q_BLOCK - length
    if pad:
        values = torch.cat([values, values[:, -1:].expand(rows, pad)], dim=1)
    return reduce(values.view(rows, blocks, Q_BLOCK), dim=-1)


STATIC_GRAPHS = 64  # compiled shapes a static-shape function may have (batch buckets x head layouts)


def own_code(fn: Any) -> Any:
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs (and counts recompiles, 8
    by default) per code object: without this every model in the process (a draft beside its
    target, several pipelines) or every use of one function would share one cache and one limit."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class FlexKernel:
    """FlexAttention compiled once for the process (dynamic shapes: every batch, length and pool
    extent on one kernel per head layout); inside an already compiled step, the plain function,
    which that compile inlines. Remembers why it failed, once it did, and says so in one line.

    On CUDA, decode rows (one query each) take a kernel compiled for static shapes instead: their
    shapes are bucketed (batch, and the pool's whole extent: ``extent_blocks``), so there are few,
    and Inductor's lowering of FlexAttention's decoding kernel failed under dynamic shapes on an
    H100 (``LoweringException: AttributeError: 'int' object has no attribute 'free_symbols'``).

    ``unfused``: run FlexAttention's reference implementation instead (it applies the mask
    function to every key of the extent, so it checks that the masks alone are exact; slow)."""

    def __init__(self) -> None:
        self.broken: str | None = None
        self.trace = ""  # the failure's whole traceback (the one-line reason is ``broken``)
        self.unfused = False
        self._compiled: dict[bool, Any] = {}  # static shapes (CUDA decode rows) or dynamic -> the compiled function

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: BlockMask,
        scale: float | None,
        block_size: int,
    ) -> torch.Tensor:
        options = {"BLOCK_N": block_size} if query.is_cuda else None  # pool blocks are the kernel's key tiles
        gqa = key.shape[1] != query.shape[1]
        if torch.compiler.is_compiling() or self.unfused:
            return flex_attention(
                query, key, value, block_mask=mask, scale=scale, enable_gqa=gqa, kernel_options=options
            )
        static = query.is_cuda and query.shape[2] == 1
        if self._compiled.get(static) is None:
            if static:  # one graph per bucket: more than dynamo's default of 8 for one function
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, STATIC_GRAPHS)
            self._compiled[static] = torch.compile(
                own_code(flex_attention) if static else flex_attention, dynamic=not static
            )
        return self._compiled[static](
            query, key, value, block_mask=mask, scale=scale, enable_gqa=gqa, kernel_options=options
        )

    def fail(self, err: Exception) -> None:
        self.trace = "".join(traceback.format_exception(err))
        first_line = (str(err).strip().splitlines() or [""])[0][:200]
        self.broken = f"FlexAttention failed ({type(err).__name__}: {first_line})"
        message = f"kv.attention=flex: {self.broken}; attention gathers each row's keys instead"
        warnings.warn(message, FlexFallback, stacklevel=3)
        print(f"mm-pipeline: {message}", file=sys.stderr)


KERNEL = FlexKernel()


def attend(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    masks: PagedMasks,
    window: bool,
    scale: float | None,
    block_size: int,
) -> torch.Tensor:
    """[B, heads, L, D] queries over the pool's first ``masks.extent`` slots, read in place."""
    keys = k_pool[: masks.extent].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, slots, D]: a view
    values = v_pool[: masks.extent].transpose(0, 1).unsqueeze(0)
    mask = masks.window if window and masks.window is not None else masks.full
    return KERNEL(query, keys, values, mask, scale, block_size)
