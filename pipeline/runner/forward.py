"""The one forward pass every prefill and decode goes through, and the greedy decode burst.

``forward`` packs the chunks' tokens into one row and runs the model once (``run_model``);
``decode_logits`` is a decode-only step built from tensors alone (the unit ``torch.compile``
sees, at bucketed shapes); ``greedy_steps`` repeats a one-token greedy step with the chosen
token fed straight back, no host work in between (a decode burst).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pipeline.kv import NULL_BLOCK, BlockPool
from pipeline.runner import flex
from pipeline.runner.attention import attach
from pipeline.runner.paged_batch import Chunk, Group, PagedBatch, build_batch, in_place_span, key_slots, padded_table
from pipeline.runner.masks import dense_mask, window_start
from pipeline.sampling import argmax
from pipeline.transfer import upload


def forward(
    lm: Any, pool: BlockPool, chunks: Sequence[Chunk], run: Any = None, device: torch.device | None = None
) -> torch.Tensor:
    """One model pass over the packed chunks; returns next-token logits [n, V]: each chunk's
    last ``logits`` rows (usually one), in chunk order. ``run``: what calls the model (``run_model``,
    or its compiled version); ``device``: where inputs go (``lm.device``, which walks the
    parameters: the engine passes it once known)."""
    model = lm.model
    if not model.__dict__.get("_mm_paged_attached"):
        attach(model)
    device = device if device is not None else lm.device
    ids = upload([[i for c in chunks for i in c.ids]], device)
    rows = len(chunks[0].positions)
    positions = upload([[p for c in chunks for p in c.positions[r]] for r in range(rows)], device)
    positions = positions.unsqueeze(1) if rows > 1 else positions  # [rows, 1, T] or [1, T]
    embeds = None
    if any(c.embeds is not None for c in chunks):
        embeds = model.get_input_embeddings()(ids)
        off = 0
        for c in chunks:
            if c.embeds is not None:  # merged media rows cover the chunk's prompt part (a prefix of it)
                embeds[0, off : off + len(c.embeds)] = c.embeds.to(embeds.device, embeds.dtype)
            off += c.count
    keep, off = [], 0
    for c in chunks:
        off += c.count
        keep.extend(range(off - int(c.logits), off))
    index = upload(keep or [off - 1], device)
    extra = lm.family.lm_inputs(chunks, device) if any(c.extras for c in chunks) else None
    pool.prepare_write()
    batch = build_batch(pool, chunks, device, in_place=run is None)
    logits = (run or run_model)(model, ids, embeds, positions, index, batch, extra)
    return logits[index] if logits.shape[0] == off and off != len(index) else logits  # no logits_to_keep support


def forward_pooled(
    lm: Any, pool: BlockPool, chunks: Sequence[Chunk], device: torch.device | None = None
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """``forward``, also handing back per chunk its row of final hidden states (``Chunk.pool``;
    float32 [H], None for a chunk that pools nothing). The decoder's output is caught by a forward
    hook, so the model runs exactly as in ``forward`` (a hooked decoder is called as a module)."""
    caught: list[torch.Tensor] = []

    def catch(_module: Any, _args: Any, out: Any) -> None:
        caught.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)

    hook = lm.model.get_decoder().register_forward_hook(catch)
    try:
        logits = forward(lm, pool, chunks, device=device)
    finally:
        hook.remove()
    return logits, pooled_rows(caught[-1][0], chunks)


def pooled_rows(hidden: torch.Tensor, chunks: Sequence[Chunk]) -> list[torch.Tensor | None]:
    """Each chunk's float32 row from the packed hidden states [T, H] (None: it pools nothing)."""
    rows: list[torch.Tensor | None] = []
    off = 0
    for c in chunks:
        part = hidden[off : off + c.count]
        off += c.count
        if c.pool == "sum":
            rows.append(part.float().sum(0))
        elif c.pool in ("first", "last"):
            rows.append(part[0 if c.pool == "first" else -1].float())
        else:
            rows.append(None)
    return rows


_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


def run_model(
    model: torch.nn.Module,
    ids: torch.Tensor,
    embeds: torch.Tensor | None,
    positions: torch.Tensor,
    index: torch.Tensor | None,
    batch: PagedBatch,
    extra: dict | None = None,
) -> torch.Tensor:
    """The model call itself, tensors in and logits out (of the packed rows ``index``; None:
    every row): the unit ``torch.compile`` sees.

    Where the logits are just the decoder's hidden states projected (``decoder.plain_head``),
    the decoder runs on its own and the output projection is applied to the kept rows; so it does
    for ``extra``, language-model inputs a family adds for prompt tokens (``Family.lm_inputs``,
    e.g. Qwen3-VL's deepstack features), which the top-level forward would not pass through.
    """
    inputs = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
    head = model.__dict__.get("_mm_head")
    if extra or head is not None:
        decoder, project = head if head is not None else (model.get_decoder(), model.get_output_embeddings())
        hidden = decoder(
            **inputs, position_ids=positions, attention_mask=_NO_MASK, use_cache=False, paged=batch, **(extra or {})
        ).last_hidden_state
        return project(hidden[0] if index is None else hidden[0, index])
    out = model(
        **inputs,
        position_ids=positions,
        attention_mask=_NO_MASK,  # any 4-D mask is passed through as is; paged attention reads the batch
        use_cache=False,
        logits_to_keep=0 if index is None else index,
        paged=batch,
    )
    return out.logits[0]


def decode_logits(
    model: torch.nn.Module,
    pool: BlockPool,
    ids: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    tables: torch.Tensor,
    extent: torch.Tensor,
) -> torch.Tensor:
    """Next-token logits [B, V] of rows that each feed one token, the batch (write slots, masks)
    built inside the call from tensors alone: the unit the compiled decode step is, so that its
    shapes are the inputs' (bucketed, ``burst_state``) and no host data enters the graph.

    ``ids`` [1, B] the tokens fed, ``positions`` [rows, 1, B] or [1, B] theirs, ``lengths`` [B]
    each row's cache length counting the fed token, ``tables`` [B, W] their block tables padded
    with the null block, ``extent`` [E, 0] (no data: its length is how many pool blocks
    FlexAttention's key tensors cover, ``flex.extent_blocks``; 2, unread, without it). Every op here runs once per
    token: keep them few.
    """
    size = pool.block_size
    last = lengths - 1
    slots = tables.gather(1, (last // size).unsqueeze(1)).squeeze(1) * size + last % size
    hi, qpos = lengths.unsqueeze(1), last.unsqueeze(1)  # one query, the row's last position: sees the row
    if flex.usable(pool, tables.device):
        masks = flex.paged_masks(tables, hi, qpos, size, extent.shape[0], pool.window)
        group = Group(ids.shape[1], 1, None, None, start=0, flex=masks)
    else:
        k_slots = key_slots(tables, size)
        keys = k_slots.shape[1]
        window = None if pool.window is None else dense_mask(keys, hi, window_start(qpos, pool.window))
        group = Group(ids.shape[1], 1, k_slots, dense_mask(keys, hi), start=0, window_mask=window)
    return run_model(model, ids, None, positions, None, PagedBatch(pool, slots, [group]))


def decode_step(
    model: torch.nn.Module,
    pool: BlockPool,
    ids: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    tables: torch.Tensor,
    extent: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One greedy decode token for every row (``decode_logits`` and the argmax in one call): the
    unit a decode burst repeats with no host work in between (see ``Engine`` and
    ``pipeline.runner.compiled``). Returns the chosen ids, the next step's positions and lengths,
    and the logits. The one function the compiled step compiles, so that greedy bursts and single
    steps (sampled rows, requests waiting) share its graphs: half the graphs of a logits function
    and a greedy one compiled apart (a 187M model's first warm-up on 2 CPU cores: 147 s for four
    graphs, 97 s for two)."""
    logits = decode_logits(model, pool, ids, positions, lengths, tables, extent)
    return argmax(logits).view(1, -1), positions + 1, lengths + 1, logits


class SingleRowStep:
    """``decode_step`` for a burst of one row, eager (without the logits): the row attends to exactly its own keys, so
    no mask is built or applied, and where its blocks are consecutive in the pool
    (``batch.in_place_span``) they are read in place, a slice of the pool with no gather. The
    key count is a Python int, one more each step (counted here: no step reads a tensor back),
    which is why a compiled step cannot take this path."""

    def __init__(self, keys: int, first_slot: int | None) -> None:
        self.keys, self.first = keys, first_slot
        self.k_slots: torch.Tensor | None = None

    def __call__(
        self,
        model: torch.nn.Module,
        pool: BlockPool,
        ids: torch.Tensor,
        positions: torch.Tensor,
        lengths: torch.Tensor,
        tables: torch.Tensor,
        extent: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, self.keys = self.keys, self.keys + 1
        if self.k_slots is None:
            self.k_slots = key_slots(tables, pool.block_size)
        span = (self.first, n) if self.first is not None else None
        group = Group(1, 1, self.k_slots[:, :n], None, start=0, span=span, alone=True)
        logits = run_model(model, ids, None, positions, None, PagedBatch(pool, self.k_slots[0, n - 1 : n], [group]))
        return argmax(logits).view(1, -1), positions + 1, lengths + 1


def single_row_step(
    pool: BlockPool, tables: Sequence[Sequence[int]], starts: Sequence[int], steps: int
) -> SingleRowStep | None:
    """The eager step for a burst of one row on a model without sliding windows (None otherwise)."""
    if len(tables) != 1 or pool.window is not None:
        return None
    span = in_place_span(pool, tables[0], starts[0] + steps)
    return SingleRowStep(starts[0] + 1, None if span is None else span[0])


BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def batch_bucket(rows: int) -> int:
    """The batch size a compiled step runs ``rows`` at: few sizes, so few graphs (and CUDA
    graphs), at most a third of the rows wasted; beyond the table, multiples of 64."""
    return next((b for b in BATCH_BUCKETS if b >= rows), -(-rows // 64) * 64)


def width_bucket(blocks: int) -> int:
    """A compiled step's block-table width: a power of two, at least 2 (dynamo specialises 1)."""
    return max(2, 1 << (blocks - 1).bit_length())


def burst_state(
    pool: BlockPool,
    fed: Sequence[int],
    positions: Sequence[Sequence[int]],
    starts: Sequence[int],
    tables: Sequence[Sequence[int]],
    steps: int,
    device: torch.device,
    bucketed: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The state ``greedy_steps`` starts from, for rows that each feed one token: ``fed`` [B],
    ``positions`` [position rows][B] the fed tokens' positions, ``starts`` [B] each row's cache
    length before it, ``tables`` [B] their block tables, padded to cover the ``steps`` positions
    the burst writes (at least 2 blocks wide: no size-1 specialisation when compiled).

    ``bucketed`` (the compiled step): the batch and the table width rounded up to their buckets.
    A padding row feeds token 0 at position 0 with an all-null table: it writes (finite values)
    into the null block, which every real row masks out, and its token is dropped."""
    width = max(2, max(-(-(s + steps) // pool.block_size) for s in starts))
    rows = len(fed)
    pad = 0
    if bucketed:
        width, pad = width_bucket(width), batch_bucket(rows) - rows
    pos = upload([list(row) + [0] * pad for row in positions], device)
    padded = [padded_table(t, width) for t in tables] + [[NULL_BLOCK] * width] * pad
    return (
        upload([list(fed) + [0] * pad], device),
        pos.unsqueeze(1) if len(positions) > 1 else pos,
        upload([s + 1 for s in starts] + [1] * pad, device),
        upload(padded, device),
        # Only FlexAttention reads the extent (and only then are never-written blocks zeroed for it).
        torch.empty(flex.extent_blocks(pool, padded, device) if flex.usable(pool, device) else 2, 0, device=device),
    )


def chunks_state(
    pool: BlockPool, chunks: Sequence[Chunk], device: torch.device, bucketed: bool
) -> tuple[torch.Tensor, ...]:
    """``burst_state`` for one step of decode ``chunks`` (one token each): what the fixed-shape
    steps (``compiled``, ``graphs``) run a single decode step from."""
    positions = [[c.positions[r][0] for c in chunks] for r in range(len(chunks[0].positions))]
    return burst_state(
        pool,
        [c.ids[0] for c in chunks],
        positions,
        [c.start for c in chunks],
        [c.table for c in chunks],
        1,
        device,
        bucketed=bucketed,
    )


def run_burst(
    lm: Any, pool: BlockPool, state: tuple[torch.Tensor, ...], steps: int, compiled: Any = None, step: Any = None
) -> list[torch.Tensor]:
    """``greedy_steps`` from ``state``, on ``compiled`` (a ``CompiledStep``) when given, else
    eagerly with ``step`` (default ``decode_step``)."""
    pool.prepare_write()
    if compiled is not None:
        return compiled.greedy_steps(lm, pool, state, steps)
    return greedy_steps(lm.model, pool, state, steps, step=step or decode_step)


def greedy_steps(
    model: torch.nn.Module,
    pool: BlockPool,
    state: tuple[torch.Tensor, ...],
    steps: int,
    step: Any = decode_step,
) -> list[torch.Tensor]:
    """``steps`` greedy steps, each fed the token the last one chose; the chosen ids [1, B] of
    each. ``step`` returns (ids, positions, lengths) and may add more (``decode_step``'s logits)."""
    ids, positions, lengths, *fixed = state  # the tables and extent stay; the rest moves on
    chosen = []
    for _ in range(steps):
        ids, positions, lengths, *_ = step(model, pool, ids, positions, lengths, *fixed)
        chosen.append(ids)
    return chosen
