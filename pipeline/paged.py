"""The paged KV pool and the one forward pass every prefill and decode goes through.

Keys and values live in a pool of fixed-size blocks (``block_size`` positions each, every
decoder layer, keys and values). A sequence is a block table (``KVCache``); many sequences
share the pool, and full blocks are kept in a **prefix cache** keyed by a hash chain of their
cache keys (token ids, media content hashes), so a later request whose prompt starts the same
way attaches those blocks instead of computing them. Blocks are reference-counted: a block
can belong to several sequences at once (forks, prefix hits); an unreferenced cached block
stays until the pool needs it (least recently used first).

The forward pass (``forward``) packs the new tokens of every sequence into one row, as
transformers' continuous batching does, and runs the model once with our attention function
registered in transformers' attention-function registry (``mm_paged``). Every linear layer
sees the packed tokens; attention writes each token's key/value into its slot and attends,
per sequence, over that sequence's blocks (decode rows batched together, prefill chunks
batched together, each padded to its group's longest; padding reads a zeroed null block and
is masked out). Positions are passed explicitly, so Qwen2-VL's 3-D rope rows and merged
image/audio embeddings go through unchanged. Called on anything but a paged batch, the
function is the model's own attention (``generate()`` on the same model is unaffected).

Why our own kernel-free attention instead of transformers' ``PagedAttentionCache``: that one
owns its scheduler state and knows neither 3-D positions nor ``inputs_embeds``; this file is
the few hundred lines that do, on plain ``scaled_dot_product_attention``.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from pipeline.errors import UserError
from pipeline.recurrent import StateBatch, StateIO, StateSlots, attach_linear, build_state_batch, state_shape
from pipeline.memory import (
    ATTENTION_KINDS,
    cache_devices,
    fmt_bytes,
    free_bytes,
    kv_bytes,
    kv_shape,
    layer_kinds,
    sliding_window,
    text_config,
    uncacheable_layers,
)

ATTENTION = "mm_paged"
NULL_BLOCK = 0  # never handed out: padding reads it (zeros), nothing writes it


class OutOfBlocks(Exception):
    """The pool has no free or evictable block left (the engine preempts or waits)."""


# --- the pool ---------------------------------------------------------------------------------
@dataclass
class _Cached:
    """A full block in the prefix cache: the chain hash, its parent's, and its own keys (checked
    on every hit, so a hash collision can never hand out the wrong keys)."""

    digest: int
    parent: int | None
    keys: tuple


class BlockPool:
    """Fixed-size KV blocks for every decoder layer, reference-counted, with an LRU prefix cache.

    Thread-safe: allocation and reference counts are guarded by one lock (caches of several
    threads and engines may share the pool).
    """

    def __init__(
        self, config: Any, num_blocks: int, block_size: int, dtype: torch.dtype, devices: Sequence[torch.device],
        state_slots: int = 0, checkpoint_every: int | None = None, reserved_slots: int = 0,
    ) -> None:
        other = uncacheable_layers(config)
        if other:
            raise UserError(f"the paged KV cache handles full, sliding-window and linear attention layers only; this "
                            f"model also has {sorted(other)}")
        if getattr(text_config(config), "use_bidirectional_attention", False):
            raise UserError("this model attends both ways over all its text (an encoder or embedding model, e.g. "
                            "EmbeddingGemma): the paged KV cache decodes causal models only")
        if num_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.layers, self.kv_heads, self.head_dim = kv_shape(config)
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.dtype = dtype
        self.block_bytes = kv_bytes(config, self.block_size, dtype)  # every layer, keys and values
        # Sliding-window layers: their window (None: the model has none). The pool keeps every
        # position for them as well; the attention masks keys older than the window.
        self.window = sliding_window(config)
        self.devices = list(devices)
        # Per attention layer, keys and values as [slots, kv_heads, head_dim]; allocated before the
        # first forward (prepare_write), on the layer's own device (accelerate may spread layers).
        # Linear-attention layers have none: their recurrent states live in ``states``.
        self._attention = [kind in ATTENTION_KINDS for kind in layer_kinds(config)]
        self._kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.layers
        self._allocated = False
        shape = state_shape(config, dtype)
        self.states = StateSlots(shape, state_slots, self.devices, reserved_slots) if shape is not None else None
        # Recurrent states are checkpointed every this many tokens (a multiple of block_size).
        self.checkpoint_every = checkpoint_every
        self.lock = threading.RLock()
        self.refs = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, NULL_BLOCK, -1))  # pop() gives low ids first
        self._by_digest: dict[int, int] = {}  # chain hash -> block
        self._cached: dict[int, _Cached] = {}  # block -> what it holds (full, registered blocks)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, LRU first
        self.hits = 0  # prefix-cache lookups that attached a block
        self.lookups = 0
        self._used = 0  # blocks with a reference count above zero
        self._fresh = bytearray(b"\x01") * self.num_blocks  # never handed out yet (memory not initialised)
        self._dirty: list[int] = []  # handed out since the last prepare_write, still to be zeroed

    # sizes ----------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence could hold with the whole pool to itself."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def used_blocks(self) -> int:
        """Blocks some sequence holds now."""
        return self._used

    @property
    def free_blocks(self) -> int:
        """Blocks that can be handed out now (free, or cached and unreferenced)."""
        with self.lock:
            return len(self._free) + len(self._evictable)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv[layer]

    def prepare_write(self) -> None:
        """Before a forward: allocate every layer's tensors (once, on each layer's device) and
        zero the blocks handed out for the first time since.

        Why zero: a masked-out slot still goes through the attention product, and uninitialised
        memory can hold NaN, which a mask does not cancel (NaN * 0 is NaN). Zeroing only blocks
        as they are first used keeps a large pool free until it fills.
        """
        with self.lock:
            if not self._allocated:
                shape = (self.num_blocks * self.block_size, self.kv_heads, self.head_dim)
                for layer, device in enumerate(self.devices or [torch.device("cpu")] * self.layers):
                    if self._attention[layer]:
                        self._kv[layer] = (torch.empty(shape, dtype=self.dtype, device=device),
                                           torch.empty(shape, dtype=self.dtype, device=device))
                self._dirty = [NULL_BLOCK] + self._dirty
                self._allocated = True
            if not self._dirty:
                return
            blocks, self._dirty = self._dirty, []
            for kv in filter(None, self._kv):  # under the lock: no forward of another engine is writing them yet
                index = torch.tensor(blocks, device=kv[0].device)
                for t in kv:
                    t.view(self.num_blocks, self.block_size, self.kv_heads, self.head_dim)[index] = 0

    # blocks ---------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A block for one sequence (reference count 1): a free one, else the least recently used
        cached block nobody holds (it leaves the prefix cache)."""
        with self.lock:
            if self._free:
                block = self._free.pop()
            elif self._evictable:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
            else:
                raise OutOfBlocks
            self.refs[block] = 1
            self._used += 1
            if self._fresh[block]:
                self._fresh[block] = 0
                self._dirty.append(block)
            return block

    def hold(self, block: int) -> None:
        with self.lock:
            if self.refs[block] == 0:
                self._evictable.pop(block, None)
                self._used += 1
            self.refs[block] += 1

    def release(self, block: int) -> None:
        with self.lock:
            self.refs[block] -= 1
            if self.refs[block] > 0:
                return
            self._used -= 1
            if block in self._cached:
                self._evictable[block] = None  # most recently used last
            else:
                self._free.append(block)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy on write: ``dst`` gets ``src``'s keys and values in every layer."""
        self.prepare_write()  # dst may be fresh: zero it first, so the copy is not zeroed later
        n = self.block_size
        for kv in filter(None, self._kv):
            for t in kv:
                t[dst * n : (dst + 1) * n] = t[src * n : (src + 1) * n]

    # prefix cache ---------------------------------------------------------------------------
    @staticmethod
    def chain(parent: int | None, keys: tuple) -> int:
        return hash((parent, keys))

    def register(self, block: int, parent: int | None, keys: tuple) -> int:
        """Record a full block's content in the prefix cache; returns its chain hash."""
        digest = self.chain(parent, keys)
        with self.lock:
            if block in self._cached:
                return self._cached[block].digest
            if digest not in self._by_digest:  # an identical block already cached stays the one found
                self._by_digest[digest] = block
            self._cached[block] = _Cached(digest, parent, keys)
        return digest

    def unregister(self, block: int) -> None:
        """Take a block out of the prefix cache before its content changes (a rollback then a write)."""
        with self.lock:
            if block in self._cached:
                self._forget(block)

    def _forget(self, block: int) -> None:
        entry = self._cached.pop(block)
        if self._by_digest.get(entry.digest) == block:
            del self._by_digest[entry.digest]
            if self.states is not None:
                self.states.forget(entry.digest)

    def lookup(self, parent: int | None, keys: tuple) -> int | None:
        """The cached block holding ``keys`` after the chain ``parent`` (held for the caller), or None."""
        with self.lock:
            self.lookups += 1
            block = self._by_digest.get(self.chain(parent, keys))
            if block is None:
                return None
            entry = self._cached[block]
            if entry.parent != parent or entry.keys != keys:
                return None
            self.hits += 1
            self.hold(block)
            return block

    def is_cached(self, digest: int) -> bool:
        """Whether a block with this chain hash is in the prefix cache now."""
        return digest in self._by_digest

    def digest_of(self, block: int) -> int | None:
        entry = self._cached.get(block)
        return entry.digest if entry is not None else None

    def clear_prefix_cache(self) -> None:
        """Forget every cached block nobody holds (e.g. between benchmark runs)."""
        with self.lock:
            for block in list(self._evictable):
                self._forget(block)
                self._free.append(block)
            self._evictable.clear()
            if self.states is not None:
                self.states.clear_registry()


def kv_memory_setting(value: Any) -> float | int | str:
    """``kv.memory`` checked: ``auto`` (also None), a number of bytes, or a fraction in (0, 1]."""
    if value is None or value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
        isinstance(value, float) and value > 1
    ):
        raise UserError(f"kv.memory must be auto, a number of bytes, or a fraction in (0, 1] (got {value!r})")
    return value


def pool_for(
    lm: Any, memory: float | int | str | None = None, block_size: int = 16, checkpoint_every: int = 1024,
    max_seqs: int = 8,
) -> BlockPool:
    """A pool sized by ``memory`` (``kv_memory_setting``): bytes, a fraction of what is free now,
    or ``auto``: 80% of free CUDA memory, or on CPU 25% of available RAM up to 2 GiB (blocks are
    touched only as they are first used, so an unused part costs nothing). Free memory honours
    ``model.max_memory``; a pool that does not fit, or has no room for one block, is refused with
    the numbers.

    A model with linear-attention layers also gets recurrent-state slots out of the same bytes
    (``state_budget``): two per sequence in flight (``max_seqs``: its state and the one a forward
    writes) plus one checkpoint per ``checkpoint_every`` tokens the blocks hold.
    """
    from pipeline.errors import whole_number

    memory = kv_memory_setting(memory)
    block_size = whole_number("kv.block_size", block_size)
    checkpoint_every = whole_number("kv.state_checkpoint_every", checkpoint_every)
    devices = cache_devices(lm)
    device = next((d for d in devices if d.type == "cuda"), devices[0] if devices else torch.device("cpu"))
    dtype = _kv_dtype(lm)
    block_bytes = kv_bytes(lm.config, block_size, dtype)
    free, source = free_bytes(device, lm)
    if memory == "auto":
        nbytes = int(0.8 * free) if device.type == "cuda" else min(int(0.25 * free), 2 << 30)
        asked = f"kv.memory=auto ({'80' if device.type == 'cuda' else '25'}% of {fmt_bytes(free)} free, {source})"
    elif isinstance(memory, float):
        nbytes = int(memory * free)
        asked = f"kv.memory={memory} of {fmt_bytes(free)} free ({source})"
    else:
        nbytes = int(memory)
        asked = f"kv.memory={nbytes:,} bytes"
        if nbytes > free:
            raise UserError(
                f"{asked} is more than the {fmt_bytes(free)} ({free:,} bytes) free on {device} ({source}): lower kv.memory"
            )
    shape = state_shape(lm.config, dtype)
    if shape is None:
        blocks, slots, reserved = nbytes // block_bytes, 0, 0
    else:
        if checkpoint_every % block_size:
            raise UserError(f"kv.state_checkpoint_every ({checkpoint_every}) must be a multiple of kv.block_size "
                            f"({block_size}): checkpoints at block boundaries serve the prefix cache")
        blocks, slots, reserved = state_budget(nbytes, block_bytes, block_size, shape.slot_bytes, checkpoint_every, max_seqs)
    if blocks < 1:
        states = f" after {slots} recurrent-state slots ({fmt_bytes(slots * shape.slot_bytes)})" if slots else ""
        raise UserError(
            f"{asked} gives {fmt_bytes(nbytes)}: not even one KV block of {block_size} tokens "
            f"({block_bytes:,} bytes){states}: raise kv.memory or model.max_memory"
        )
    return BlockPool(lm.config, blocks + 1, block_size, dtype, devices,  # + the null block
                     state_slots=slots + 1 if slots else 0, checkpoint_every=checkpoint_every, reserved_slots=reserved)


def state_budget(
    nbytes: int, block_bytes: int, block_size: int, slot_bytes: int, checkpoint_every: int, max_seqs: int
) -> tuple[int, int, int]:
    """(KV blocks, state slots, slots reserved for live states) that fit in ``nbytes``: each
    sequence in flight needs two slots; checkpoints get one slot per ``checkpoint_every`` tokens
    of blocks, and at least two per sequence (its prompt's end and last block boundary)."""
    live = 2 * max_seqs
    per_token = block_bytes / block_size + slot_bytes / checkpoint_every
    tokens = max(0, nbytes - (live + 2 * max_seqs) * slot_bytes) / per_token
    checkpoints = max(2 * max_seqs, -(-int(tokens) // checkpoint_every))
    blocks = int((nbytes - (live + checkpoints) * slot_bytes) // block_bytes)
    return max(blocks, 0), live + checkpoints, live


def _kv_dtype(lm: Any) -> torch.dtype:
    """Keys and values come out in the compute dtype (bf16/fp16 under 4-bit weights too)."""
    dtype = getattr(lm.model, "dtype", torch.float32)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        dtype = torch.float32
    quant = getattr(getattr(lm.model, "config", None), "quantization_config", None)
    compute = getattr(quant, "bnb_4bit_compute_dtype", None)
    return compute if isinstance(compute, torch.dtype) else dtype


# --- one packed forward -----------------------------------------------------------------------
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

    @property
    def count(self) -> int:
        return len(self.ids)


@dataclass
class Group:
    """Chunks attended together, padded to ``q`` queries and ``K`` keys each.

    ``start``: where the group's queries begin in the packed tokens when they are contiguous and
    unpadded (decode rows, or a single prefill chunk): then no gather or scatter is needed.
    Otherwise ``q_index`` [B, q] gathers them and ``dest`` / ``src`` put the real rows back.
    """

    rows: int
    q: int
    k_slots: torch.Tensor  # [B, K] pool slot of every key position (padding: the null block)
    mask: torch.Tensor  # [B, 1, q, K] causal (or-ed with bidirectional blocks) within the sequence, up to its length
    start: int | None
    q_index: torch.Tensor | None = None
    dest: torch.Tensor | None = None  # packed token index of each real query
    src: torch.Tensor | None = None  # its row in the flattened [B * q] output
    window_mask: torch.Tensor | None = None  # ``mask`` and'ed with the sliding window (models that have one)


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


def decode_mask(k_slots: torch.Tensor, lengths: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[B, 1, 1, K] for decode rows: the one query is the last position, so causal means every
    key within the row's length (``lengths`` [B], counting the query's own token).

    ``window``: also drop keys the sliding window no longer sees. transformers' rule
    (``masking_utils.sliding_window_overlay``) keeps key ``k`` for query ``q`` when
    ``k > q - window``; here ``q = length - 1``, so ``k >= length - window``.
    """
    k_pos = torch.arange(k_slots.shape[1], device=k_slots.device)
    mask = k_pos < lengths.view(-1, 1)
    if window is not None:
        mask = mask & (k_pos >= lengths.view(-1, 1) - window)
    return mask[:, None, None, :]


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
    chunks: Sequence[Chunk], offsets: Sequence[int], block_size: int, device: torch.device, window: int | None = None
) -> Group:
    """Padded query / key indices and the masks of a set of chunks attended together.

    ``window``: the model's sliding window; then ``window_mask`` is built too (once per batch,
    for every sliding layer), as transformers composes it: AND(window, OR(causal, block)).
    """
    q = max(c.count for c in chunks)
    blocks = max(-(-(c.start + c.count) // block_size) for c in chunks)
    table = torch.tensor([padded_table(c.table, blocks) for c in chunks], device=device)
    k_slots = key_slots(table, block_size)
    k_len = torch.tensor([c.start + c.count for c in chunks], device=device)
    window_mask = None
    if q == 1:
        mask = decode_mask(k_slots, k_len)
        if window is not None:
            window_mask = decode_mask(k_slots, k_len, window)
    else:
        k_pos = torch.arange(k_slots.shape[1], device=device)
        rows = [_query_limits(c, q) for c in chunks]
        limit = torch.tensor([lim for _, lim in rows], device=device).unsqueeze(-1)
        mask = ((k_pos < limit) & (k_pos < k_len.view(-1, 1, 1))).unsqueeze(1)
        if window is not None:
            qp = torch.tensor([pos for pos, _ in rows], device=device).unsqueeze(-1)
            window_mask = mask & (k_pos > qp - window).unsqueeze(1)
    contiguous = all(c.count == q for c in chunks) and all(
        offsets[i] == offsets[0] + i * q for i in range(len(chunks))
    )
    if contiguous:
        return Group(len(chunks), q, k_slots, mask, start=offsets[0], window_mask=window_mask)
    q_index = [[off + min(i, c.count - 1) for i in range(q)] for c, off in zip(chunks, offsets)]
    dest = [off + i for c, off in zip(chunks, offsets) for i in range(c.count)]
    src = [r * q + i for r, c in enumerate(chunks) for i in range(c.count)]
    return Group(
        len(chunks), q, k_slots, mask, start=None, q_index=torch.tensor(q_index, device=device),
        dest=torch.tensor(dest, device=device), src=torch.tensor(src, device=device), window_mask=window_mask,
    )


def build_batch(pool: BlockPool, chunks: Sequence[Chunk], device: torch.device) -> PagedBatch:
    """Decode rows (one token each) form one group, prefill chunks another."""
    offsets, total = [], 0
    for c in chunks:
        offsets.append(total)
        total += c.count
    slots = torch.tensor([i for c in chunks for i in c.slots], device=device)
    decode = [i for i, c in enumerate(chunks) if c.count == 1]
    prefill = [i for i, c in enumerate(chunks) if c.count > 1]
    groups = [
        _group([chunks[i] for i in members], [offsets[i] for i in members], pool.block_size, device, pool.window)
        for members in (decode, prefill)
        if members
    ]
    states = build_state_batch(pool.states, chunks, device) if pool.states is not None else None
    return PagedBatch(pool, slots, groups, states)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Write the packed tokens' keys/values into their slots, then attend per sequence.

    ``query`` [1, heads, T, D], ``key``/``value`` [1, kv_heads, T, D] (the new tokens only).
    A layer that passes ``sliding_window=W`` (transformers' attention modules do, None for full
    layers) attends with the batch's window masks. Anything but a paged batch goes to the
    model's own attention function.
    """
    batch: PagedBatch | None = kwargs.pop("paged", None)
    if batch is None:
        original = getattr(module.config, "_mm_paged_original", None) or "sdpa"
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(original, None)
        if fn is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as fn
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    window = kwargs.get("sliding_window")
    if window is not None and window != batch.pool.window:
        raise ValueError(f"layer {module.layer_idx} attends with sliding_window={window} but the KV pool was built "
                         f"for {batch.pool.window} (the config's layer types disagree with the model)")
    if kwargs.get("softcap") is not None:
        raise ValueError("the paged attention has no logit soft-capping (this model's layers pass softcap)")
    k_pool, v_pool = batch.pool.layer_kv(module.layer_idx)
    k_pool.index_copy_(0, batch.slots, key[0].transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(0, batch.slots, value[0].transpose(0, 1).to(v_pool.dtype))
    heads, tokens, dim = query.shape[1], query.shape[2], query.shape[3]
    flat_q = query[0].transpose(0, 1)  # [T, heads, D]
    parts = []
    for g in batch.groups:
        rows, q = g.mask.shape[0], g.mask.shape[2]  # sizes from tensors: symbolic under torch.compile
        if g.start is not None:
            qs = flat_q[g.start : g.start + rows * q].reshape(rows, q, heads, dim).transpose(1, 2)
        else:
            qs = flat_q[g.q_index].transpose(1, 2)  # [B, heads, q, D]
        ks = k_pool[g.k_slots].transpose(1, 2).to(qs.dtype)  # [B, kv_heads, K, D]
        vs = v_pool[g.k_slots].transpose(1, 2).to(qs.dtype)
        kv_heads = ks.shape[1]
        mask = g.mask if window is None else g.window_mask
        if g.q == 1 and kv_heads != heads:
            # One query per row: the query heads sharing a key/value head become its rows
            # (no repeated keys, one mask for all of them).
            o = scaled_dot_product_attention(qs.reshape(rows, kv_heads, heads // kv_heads, dim), ks, vs,
                                             attn_mask=mask, scale=scaling)
            o = o.reshape(rows, heads, 1, dim)
        else:
            o = scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling, enable_gqa=kv_heads != heads)
        parts.append((g, o.transpose(1, 2).reshape(rows * q, heads, dim)))
    if len(parts) == 1 and parts[0][0].start == 0 and parts[0][1].shape[0] == tokens:
        return parts[0][1].unsqueeze(0), None  # one contiguous group: already in packed order
    out = query.new_empty(tokens, heads, dim)
    for g, o in parts:
        if g.start is not None:
            out[g.start : g.start + o.shape[0]] = o
        else:
            out.index_copy_(0, g.dest, o.index_select(0, g.src))
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION, paged_attention)
AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def attach(model: torch.nn.Module) -> None:
    """Route the language model's attention through ``paged_attention`` (idempotent). Outside
    paged forwards it calls the implementation the model had, so nothing else changes."""
    text = text_config(model.config)
    current = text._attn_implementation
    if current != ATTENTION:
        text._mm_paged_original = current or "sdpa"
        text._attn_implementation = ATTENTION
    attach_linear(model, state_shape(model.config, torch.float32))
    model.__dict__["_mm_paged_attached"] = True  # forward checks this, not the (slow) config


def detach(model: torch.nn.Module) -> None:
    """Give the model back its own attention implementation (e.g. before transformers'
    ``generate_batch``, which accepts only its own); the next paged forward attaches again."""
    text = text_config(model.config)
    if text._attn_implementation == ATTENTION:
        text._attn_implementation = text._mm_paged_original
    model.__dict__.pop("_mm_paged_attached", None)


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
    ids = torch.tensor([[i for c in chunks for i in c.ids]], device=device)
    rows = len(chunks[0].positions)
    positions = torch.tensor([[p for c in chunks for p in c.positions[r]] for r in range(rows)], device=device)
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
    index = torch.tensor(keep or [off - 1], device=device)
    extra = lm.family.lm_inputs(chunks, device) if any(c.extras for c in chunks) else None
    pool.prepare_write()
    logits = (run or run_model)(model, ids, embeds, positions, index, build_batch(pool, chunks, device), extra)
    return logits[index] if logits.shape[0] == off and off != len(index) else logits  # no logits_to_keep support


_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


def run_model(
    model: torch.nn.Module,
    ids: torch.Tensor,
    embeds: torch.Tensor | None,
    positions: torch.Tensor,
    index: torch.Tensor,
    batch: PagedBatch,
    extra: dict | None = None,
) -> torch.Tensor:
    """The model call itself, tensors in and logits out: the unit ``torch.compile`` sees.

    ``extra``: language-model inputs a family adds for prompt tokens (``Family.lm_inputs``, e.g.
    Qwen3-VL's deepstack features), which the top-level forward would not pass through: then the
    decoder runs on its own and the output projection is applied to the kept rows.
    """
    inputs = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
    if extra:
        hidden = model.get_decoder()(
            **inputs, position_ids=positions, attention_mask=_NO_MASK, use_cache=False, paged=batch, **extra
        ).last_hidden_state
        return model.get_output_embeddings()(hidden[0, index])
    out = model(
        **inputs,
        position_ids=positions,
        attention_mask=_NO_MASK,  # any 4-D mask is passed through as is; paged attention reads the batch
        use_cache=False,
        logits_to_keep=index,
        paged=batch,
    )
    return out.logits[0]


def greedy_step(
    model: torch.nn.Module,
    pool: BlockPool,
    ids: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One greedy decode token for every row, batch built and token chosen inside the call: the
    unit a decode burst repeats with no host work in between (see ``Engine`` and
    ``pipeline.compiled``).

    ``ids`` [1, B] the tokens fed, ``positions`` [rows, 1, B] or [1, B] theirs, ``lengths`` [B]
    each row's cache length counting the fed token, ``table`` [B, blocks] its block table
    (padded with the null block, covering every position the burst writes). Returns the chosen
    ids and the next step's positions and lengths.
    """
    bs = pool.block_size
    last = lengths - 1
    slots = table.gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs
    k_slots = key_slots(table, bs)
    window = None if pool.window is None else decode_mask(k_slots, lengths, pool.window)
    group = Group(ids.shape[1], 1, k_slots, decode_mask(k_slots, lengths), start=0, window_mask=window)
    batch = PagedBatch(pool, slots, [group])
    index = torch.arange(ids.shape[1], device=ids.device)
    logits = run_model(model, ids, None, positions, index, batch)
    return logits.argmax(dim=-1).view(1, -1), positions + 1, lengths + 1


def burst_state(
    pool: BlockPool,
    fed: Sequence[int],
    positions: Sequence[Sequence[int]],
    starts: Sequence[int],
    tables: Sequence[Sequence[int]],
    steps: int,
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """The state ``greedy_steps`` starts from, for rows that each feed one token: ``fed`` [B],
    ``positions`` [position rows][B] the fed tokens' positions, ``starts`` [B] each row's cache
    length before it, ``tables`` [B] their block tables, padded to cover the ``steps`` positions
    the burst writes (at least 2 blocks wide: no size-1 specialisation when compiled)."""
    width = max(2, max(-(-(s + steps) // pool.block_size) for s in starts))
    pos = torch.tensor([list(row) for row in positions], device=device)
    return (
        torch.tensor([list(fed)], device=device),
        pos.unsqueeze(1) if len(positions) > 1 else pos,
        torch.tensor([s + 1 for s in starts], device=device),
        torch.tensor([padded_table(t, width) for t in tables], device=device),
    )


def run_burst(lm: Any, pool: BlockPool, state: tuple[torch.Tensor, ...], steps: int, compiled: Any = None) -> list[torch.Tensor]:
    """``greedy_steps`` from ``state``, on ``compiled`` (a ``CompiledStep``) when given."""
    pool.prepare_write()
    if compiled is not None:
        return compiled.greedy_steps(lm, pool, state, steps)
    return greedy_steps(lm.model, pool, state, steps)


def greedy_steps(
    model: torch.nn.Module,
    pool: BlockPool,
    state: tuple[torch.Tensor, ...],
    steps: int,
    step: Any = greedy_step,
    settled: Any = None,
) -> list[torch.Tensor]:
    """``steps`` greedy steps, each fed the token the last one chose; the chosen ids [1, B] of
    each. ``settled``: a context entered for the steps after the second, whose inputs look
    exactly like the second's (the compiled path stops re-checking its guards there)."""
    ids, positions, lengths, table = state
    chosen = []
    with contextlib.ExitStack() as stack:
        for i in range(steps):
            if i == 2 and settled is not None:
                stack.enter_context(settled())
            ids, positions, lengths = step(model, pool, ids, positions, lengths, table)
            chosen.append(ids)
    return chosen

