"""The block manager: fixed-size KV blocks, reference-counted, with an LRU prefix cache.

Keys and values live in a pool of fixed-size blocks (``block_size`` positions each, every
decoder layer, keys and values). A sequence is a block table (``pipeline.kv.cache.KVCache``);
many sequences share the pool, and full blocks are kept in a **prefix cache** keyed by a hash
chain of their cache keys (token ids, media content hashes), so a later request whose prompt
starts the same way attaches those blocks instead of computing them. Blocks are
reference-counted: a block can belong to several sequences at once (forks, prefix hits); an
unreferenced cached block stays until the pool needs it (least recently used first).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pipeline.errors import OutOfBlocks, UserError
from pipeline.kv.states import StateSlots, state_shape
from pipeline.memory import ATTENTION_KINDS, kv_bytes, kv_shape, layer_kinds, sliding_window, text_config, uncacheable_layers
from pipeline.transfer import upload

__all__ = ["ATTENTION", "BlockPool", "NULL_BLOCK", "OutOfBlocks"]

ATTENTION = ("auto", "flex", "sdpa")  # how attention reads the pool (kv.attention; pipeline.runner.flex)

NULL_BLOCK = 0  # never handed out: padding reads it (masked out); only a compiled step's padding rows write it


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
        attention: str = "auto", shards: int = 1,
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
        # Under tensor parallel (``shards`` ranks) each rank's pool holds its own key/value heads.
        self.shards = shards
        self.layers, self.kv_heads, self.head_dim = kv_shape(config, shards)
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.dtype = dtype
        self.block_bytes = kv_bytes(config, self.block_size, dtype, shards)  # every layer, keys and values
        # Sliding-window layers: their window (None: the model has none). The pool keeps every
        # position for them as well; the attention masks keys older than the window.
        self.window = sliding_window(config)
        self.devices = list(devices)
        # How attention reads the pool (``kv.attention``): "flex", FlexAttention over the blocks in
        # place (``pipeline.runner.flex``); "sdpa", each row's keys gathered for SDPA; "auto",
        # flex on CUDA and sdpa on CPU.
        self.attention = attention
        # Per attention layer, keys and values as [slots, kv_heads, head_dim]; allocated before the
        # first forward (prepare_write), on the layer's own device (accelerate may spread layers).
        # Linear-attention layers have none: their recurrent states live in ``states``.
        self._attention = [kind in ATTENTION_KINDS for kind in layer_kinds(config)]
        self._kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.layers
        self._allocated = False
        self._stores: list[torch.Tensor] = []
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
        self._exposed = 0  # blocks below this are read whole by attention (expose): none is fresh
        # Rank 0 under tensor parallel: the blocks zeroed for their first use and the copy_block calls
        # since the last step, which the other ranks replay on their pools before the same step
        # (``pipeline.runner.mirror``): only rank 0 hands out blocks.
        self.zeroed: list[int] | None = None
        self.copies: list[tuple[int, int]] | None = None

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
        """Before a forward: allocate the pool (once) and zero the blocks handed out for the first
        time since, all layers in one call per device.

        Why zero: a masked-out slot still goes through the attention product, and uninitialised
        memory can hold NaN, which a mask does not cancel (NaN * 0 is NaN). Zeroing only blocks
        as they are first used keeps a large pool free until it fills.
        """
        with self.lock:
            if not self._allocated:
                self._allocate()
            if not self._dirty:
                return
            blocks, self._dirty = self._dirty, []
            if self.zeroed is not None:
                self.zeroed.extend(blocks)
            for store in self._stores:  # under the lock: no forward of another engine is writing them yet
                store.index_fill_(2, upload(blocks, store.device), 0)

    def expose(self, blocks: int) -> None:
        """Attention is about to read the first ``blocks`` blocks whole, listed or not (FlexAttention's
        key tensors; its reference path weighs every key): zero those never handed out, as
        ``prepare_write`` does for blocks handed out. Amortised: each block is looked at once."""
        with self.lock:
            if blocks <= self._exposed:
                return
            for block in range(self._exposed, blocks):
                if self._fresh[block]:
                    self._fresh[block] = 0
                    self._dirty.append(block)
            self._exposed = blocks
            self.prepare_write()

    def _allocate(self) -> None:
        """One tensor per device, [layers there, keys/values, blocks, block_size, kv_heads,
        head_dim], each layer's keys and values views of it: new blocks are zeroed in one call,
        and the pool's address never changes (a captured CUDA graph writes into it)."""
        devices = self.devices or [torch.device("cpu")] * self.layers
        by_device: dict[torch.device, list[int]] = {}
        for layer, device in enumerate(devices):
            if self._attention[layer]:
                by_device.setdefault(torch.device(device), []).append(layer)
        self._stores = []
        slots = self.num_blocks * self.block_size
        for device, layers in by_device.items():
            store = torch.empty((len(layers), 2, self.num_blocks, self.block_size, self.kv_heads, self.head_dim),
                                dtype=self.dtype, device=device)
            self._stores.append(store)
            for i, layer in enumerate(layers):
                self._kv[layer] = (store[i, 0].view(slots, self.kv_heads, self.head_dim),
                                   store[i, 1].view(slots, self.kv_heads, self.head_dim))
        self._dirty = [NULL_BLOCK] + self._dirty
        self._allocated = True

    @property
    def stores(self) -> list[torch.Tensor]:
        """The pool's tensors (one per device; empty before the first forward)."""
        return list(self._stores)

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every attention layer's key and value views (what a forward reads and writes)."""
        return [t for kv in self._kv if kv is not None for t in kv]

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
        for store in self._stores:
            store[:, :, dst] = store[:, :, src]
        if self.copies is not None:
            self.copies.append((src, dst))

    def zero(self, blocks: list[int]) -> None:
        """Another rank's replica (tensor parallel): zero the blocks rank 0 zeroed for their first
        use, so they are no longer fresh here either (``expose`` must not wipe them later)."""
        with self.lock:
            for block in blocks:
                if self._fresh[block]:
                    self._fresh[block] = 0
                    self._dirty.append(block)
            self.prepare_write()

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

