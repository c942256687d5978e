"""Batch building: the packed chunks of one forward and the index tensors attention reads.

A step's new tokens (one per decoding sequence, a chunk per prefilling one) are packed into one
row, as transformers' continuous batching does. ``build_batch`` turns the chunks into what every
layer shares: each token's write slot, and per group of rows (decode rows together, prefill
chunks together, each padded to its group's longest; padding reads the zeroed null block and is
masked out) the key slots and masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pipeline.kv import NULL_BLOCK, BlockPool, StateIO
from pipeline.runner import flex
from pipeline.runner.linear import StateBatch, build_state_batch
from pipeline.runner.masks import dense_mask, window_start
from pipeline.transfer import upload


@dataclass
class Chunk:
    """New tokens of one sequence for one forward: ``count`` tokens from cache position ``start``.

    Plain lists, so that building a step costs a few tensors for the whole batch, not a few per
    sequence: ``ids`` [count], ``positions`` [rows][count] (rows: 1, or 4 for Qwen2-VL's M-RoPE),
    ``slots`` [count] where their keys/values go (from ``KVCache.reserve``). ``embeds``
    [n <= count, hidden]: merged media embeddings of the first n tokens (the prompt part; tokens
    generated after it, recomputed after a preemption, use ``ids``).
    """

    table: list[int]  # the sequence's block table after reserving these tokens
    start: int
    ids: list[int]
    positions: list[list[int]]
    slots: list[int]
    embeds: torch.Tensor | None = None
    state: StateIO | None = None  # recurrent-state slots (models with linear-attention layers)
    logits: int = 1  # keep the logits of its last N tokens (1: next-token; 0: none; more: verifying drafts)
    extras: dict | None = None  # the family's per-token inputs for the prompt part (Family.chunk_extras)
    pool: str | None = None  # hand back its final hidden states' "sum", "first" or "last" row (embeddings)
    adapter: Any = None  # its request's LoRA adapter (pipeline.model.lora.Adapter; None: the base model)

    @property
    def count(self) -> int:
        return len(self.ids)


@dataclass
class Group:
    """Chunks attended together, padded to ``q`` queries and ``K`` keys each.

    ``start``: where the group's queries begin in the packed tokens when they are contiguous and
    unpadded (decode rows, or a single prefill chunk): then no gather or scatter is needed.
    Otherwise ``q_index`` [B, q] gathers them and ``dest`` / ``src`` put the real rows back.

    ``alone``: one decode row over exactly its keys, no mask (``lone_decode``): where PyTorch's
    kernels run, attended by the call ``generate()`` makes (``attention._attend_alone``); where
    the native ones do, by their kernel over ``k_slots`` (a lone row's keys always have them).
    ``span`` (first slot, keys): its keys are consecutive pool slots (a lone stream on a fresh
    pool gets its blocks in order): PyTorch's kernels read them in place, a slice of the pool with
    no gather. A prefill chunk with a ``span`` has no ``k_slots``. A group with ``k_slots`` and no
    ``mask`` attends to every key it names. Eager steps only: both carry the key count as a
    Python int, which a compiled step would specialise on.

    ``flex``: the group is attended by FlexAttention over the pool in place (``runner.flex``);
    then ``k_slots`` and the masks are None.
    """

    rows: int
    q: int
    k_slots: torch.Tensor | None  # [B, K] pool slot of every key position (padding: the null block)
    mask: (
        torch.Tensor | None
    )  # [B, 1, q, K] causal (or-ed with bidirectional blocks) within the sequence, up to its length
    start: int | None
    q_index: torch.Tensor | None = None
    dest: torch.Tensor | None = None  # packed token index of each real query
    src: torch.Tensor | None = None  # its row in the flattened [B * q] output
    window_mask: torch.Tensor | None = None  # ``mask`` and'ed with the sliding window (models that have one)
    span: tuple[int, int] | None = None
    alone: bool = False
    causal: bool = False  # one prefill chunk, plainly causal: no mask tensor (``causal_chunk``)
    flex: flex.PagedMasks | None = None


def in_place_span(pool: BlockPool, table: Sequence[int], keys: int) -> tuple[int, int] | None:
    """(first slot, keys) when the blocks holding a row's first ``keys`` positions are
    consecutive in the pool and every layer attends to all of them (no sliding window)."""
    used = -(-keys // pool.block_size)
    if pool.window is not None or len(table) < used or any(table[i] != table[0] + i for i in range(used)):
        return None
    return table[0] * pool.block_size, keys


def causal_chunk(pool: BlockPool, chunk: Chunk, start: int, device: torch.device) -> Group:
    """The group of a prefill chunk attended alone whose mask is plainly causal (no bidirectional
    media blocks, no sliding window): no mask is built. Its queries see every cached key and the
    chunk's keys up to their own, which is causality aligned to the bottom right; attention then
    runs a fused kernel (``is_causal``, or ``causal_lower_right`` over cached keys) instead of
    one that reads a [q, keys] mask and builds the score matrix. A chunk from position 0 attends
    to its own new keys (no read of the pool); otherwise its keys are read in place where its
    blocks are consecutive, else gathered."""
    keys = chunk.start + chunk.count
    span = in_place_span(pool, chunk.table, keys) if chunk.start else None
    k_slots = exact_slots(pool, chunk.table, keys, device) if chunk.start and span is None else None
    return Group(1, chunk.count, k_slots, None, start=start, span=span, causal=True)


def lone_decode(pool: BlockPool, chunk: Chunk, start: int, device: torch.device) -> Group:
    """The group of an eager step's only decode row (no sliding window): its keys exactly, no
    mask, so that attention makes ``generate()``'s own call for a lone row
    (``attention._attend_alone``), read in place where its blocks are consecutive; or the native
    kernel's over the same slots wherever they lie (the row's answer must not depend on where the
    pool put its blocks)."""
    keys = chunk.start + 1
    span = in_place_span(pool, chunk.table, keys)
    return Group(1, 1, exact_slots(pool, chunk.table, keys, device), None, start=start, span=span, alone=True)


def exact_slots(pool: BlockPool, table: Sequence[int], keys: int, device: torch.device) -> torch.Tensor:
    """[1, keys] pool slot of each of a row's first ``keys`` positions (no padding)."""
    blocks = -(-keys // pool.block_size)
    return key_slots(upload([padded_table(table, blocks)], device), pool.block_size)[:, :keys]


def plainly_causal(pool: BlockPool, chunk: Chunk) -> bool:
    """Whether a chunk's attention mask is causal and nothing else."""
    return pool.window is None and not (chunk.extras or {}).get("blocks")


def _fused_causal(pool: BlockPool, chunk: Chunk, prefill_flex: bool) -> bool:
    """Whether a prefill chunk takes ``causal_chunk``: plainly causal, and (where
    FlexAttention reads the pool for prefill) its keys need no gather: it starts at position 0
    or its blocks are consecutive."""
    if not plainly_causal(pool, chunk):
        return False
    return (
        not prefill_flex or not chunk.start or in_place_span(pool, chunk.table, chunk.start + chunk.count) is not None
    )


@dataclass
class PagedBatch:
    """What attention needs for one packed forward, built once and shared by every layer."""

    pool: BlockPool
    slots: torch.Tensor  # [T] write slot of each packed token
    groups: list[Group]
    states: StateBatch | None = None  # linear-attention layers' state slots (pipeline.recurrent)


def padded_table(blocks: Sequence[int], width: int) -> list[int]:
    """A block table cut or padded (with the null block) to ``width`` blocks."""
    return list(blocks[:width]) + [NULL_BLOCK] * (width - min(len(blocks), width))


def key_slots(table: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, blocks] block tables -> [B, blocks * block_size] pool slot of every key position."""
    return (table.unsqueeze(-1) * block_size + torch.arange(block_size, device=table.device)).flatten(1)


def _query_limits(chunk: Chunk, q: int) -> tuple[list[int], list[int]]:
    """Per padded query row of ``chunk``: its position, and the first key position it may not
    see: position + 1 (causal), or the end of the bidirectional block it lies in (the family's
    ``bidirectional_spans``, in ``chunk.extras["blocks"]``), which it sees whole.

    So OR(causal, same block) is ``key < limit``: every key before the block is causal anyway.
    The engine never ends a chunk inside a block, so a block's keys are all in the cache or in
    the chunk.
    """
    n = chunk.count
    positions = [chunk.start + min(i, n - 1) for i in range(q)]  # padding rows repeat the last query
    limits = [p + 1 for p in positions[:n]]
    for begin, end in (chunk.extras or {}).get("blocks") or ():
        lo, hi = max(begin - chunk.start, 0), min(end - chunk.start, n)
        limits[lo:hi] = [end] * max(0, hi - lo)
    return positions, limits + limits[-1:] * (q - n)


def _group(
    chunks: Sequence[Chunk], offsets: Sequence[int], pool: BlockPool, device: torch.device, use_flex: bool
) -> Group:
    """Padded query / key indices and the masks of a set of chunks attended together.

    Each query sees the key positions below ``hi`` (its limit, cut at its row's length) and, in
    sliding layers, from its window's start (``runner.masks``), as transformers composes it:
    AND(window, OR(causal, block)). ``use_flex``: as FlexAttention's block masks over the pool
    (``runner.flex``); otherwise each row's key slots (gathered by attention) and boolean masks.
    """
    q = max(c.count for c in chunks)
    blocks = max(-(-(c.start + c.count) // pool.block_size) for c in chunks)
    tables = [padded_table(c.table, blocks) for c in chunks]
    table = upload(tables, device)
    hi = upload([c.start + c.count for c in chunks], device).unsqueeze(1)  # [B, 1]: each row's length
    qpos = hi - 1 if pool.window is not None else None  # a decode row's query is its last position
    if q > 1:
        rows = [_query_limits(c, q) for c in chunks]
        hi = torch.minimum(upload([lim for _, lim in rows], device), hi)
        qpos = upload([pos for pos, _ in rows], device) if pool.window is not None else None
    if use_flex:
        masks = flex.paged_masks(
            table, hi, qpos, pool.block_size, flex.extent_blocks(pool, tables, device), pool.window
        )
        return _placed(chunks, offsets, q, device, Group(len(chunks), q, None, None, start=None, flex=masks))
    k_slots = key_slots(table, pool.block_size)
    keys = k_slots.shape[1]
    window_mask = None if qpos is None else dense_mask(keys, hi, window_start(qpos, pool.window))
    return _placed(
        chunks,
        offsets,
        q,
        device,
        Group(len(chunks), q, k_slots, dense_mask(keys, hi), start=None, window_mask=window_mask),
    )


def _placed(chunks: Sequence[Chunk], offsets: Sequence[int], q: int, device: torch.device, group: Group) -> Group:
    """``group`` with where its queries are in the packed tokens: a start when they are contiguous
    and unpadded, else the gather and scatter indices."""
    if all(c.count == q for c in chunks) and all(offsets[i] == offsets[0] + i * q for i in range(len(chunks))):
        group.start = offsets[0]
        return group
    group.q_index = upload([[off + min(i, c.count - 1) for i in range(q)] for c, off in zip(chunks, offsets)], device)
    group.dest = upload([off + i for c, off in zip(chunks, offsets) for i in range(c.count)], device)
    group.src = upload([r * q + i for r, c in enumerate(chunks) for i in range(c.count)], device)
    return group


def build_batch(pool: BlockPool, chunks: Sequence[Chunk], device: torch.device, in_place: bool = False) -> PagedBatch:
    """Decode rows (one token each) form one group; prefill chunks another, or one each where all
    are plainly causal (``causal_chunk``: each attended as it is alone). ``in_place``: a lone
    decode row attends over exactly its keys, in place where its blocks are consecutive
    (``lone_decode``; eager only)."""
    offsets, total = [], 0
    for c in chunks:
        offsets.append(total)
        total += c.count
    slots = upload([i for c in chunks for i in c.slots], device)
    decode = [i for i, c in enumerate(chunks) if c.count == 1]
    prefill = [i for i, c in enumerate(chunks) if c.count > 1]

    def group(members: list[int], use_flex: bool) -> Group:
        return _group([chunks[i] for i in members], [offsets[i] for i in members], pool, device, use_flex)

    groups = []
    if decode:
        lone = in_place and len(decode) == 1 and pool.window is None
        groups.append(
            lone_decode(pool, chunks[decode[0]], offsets[decode[0]], device)
            if lone
            else group(decode, flex.usable(pool, device))
        )
    prefill_flex = flex.usable_for_prefill(pool, device)
    if prefill and all(_fused_causal(pool, chunks[i], prefill_flex) for i in prefill):
        # each chunk attended as it is alone: one masked call over them all rounds otherwise, and
        # in bfloat16 a request's answer then depended on which others were prefilled with it
        groups += [causal_chunk(pool, chunks[i], offsets[i], device) for i in prefill]
    elif prefill:
        groups.append(group(prefill, prefill_flex))
    states = build_state_batch(pool.states, chunks, device) if pool.states is not None else None
    return PagedBatch(pool, slots, groups, states)
