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

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pipeline.errors import OutOfBlocks, UserError
from pipeline.kv.quantised import LayerKV, kv_format
from pipeline.kv.states import StateSlots, state_shape
from pipeline.memory import (
    ATTENTION_KINDS,
    KV_SCALE_DTYPE,
    kv_bytes,
    kv_shape,
    layer_kinds,
    sliding_window,
    text_config,
    uncacheable_layers,
)
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
        self,
        config: Any,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        devices: Sequence[torch.device],
        state_slots: int = 0,
        checkpoint_every: int | None = None,
        reserved_slots: int = 0,
        attention: str = "auto",
        shards: int = 1,
        kv_dtype: str = "auto",
    ) -> None:
        other = uncacheable_layers(config)
        if other:
            raise UserError(
                f"the paged KV cache handles full, sliding-window and linear attention layers only; this "
                f"model also has {sorted(other)}"
            )
        # A text model's own flag (EmbeddingGemma). Inside a multimodal config it is the outer model that builds
        # the mask (PaliGemma sets it on its Gemma and attends causally past the prompt): the family says how.
        if text_config(config) is config and getattr(config, "use_bidirectional_attention", False):
            raise UserError(
                "this model attends both ways over all its text (an encoder or embedding model, e.g. "
                "EmbeddingGemma): the paged KV cache decodes causal models only"
            )
        if num_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        # Under tensor parallel (``shards`` ranks) each rank's pool holds its own key/value heads.
        self.shards = shards
        self.layers, self.kv_heads, self.head_dim = kv_shape(config, shards)
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.dtype = dtype  # the model's: what attention computes in (and recurrent states are kept in)
        # ``kv.dtype``: keys and values stored in ``dtype`` ("auto") or quantised (``self.format``:
        # pipeline.kv.quantised), one byte an element and a scale per position and head.
        self.kv_dtype = kv_dtype
        self.format = kv_format(kv_dtype)
        self.block_bytes = kv_bytes(config, self.block_size, dtype, shards, kv_dtype)  # every layer, keys and values
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
        self._kv: list[LayerKV | None] = [None] * self.layers
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
        # A second tier (``kv.offload``: pipeline.kv.tier) for the full blocks this pool evicts:
        # ``lookup`` loads a block from it instead of the prefill recomputing it.
        self.tier: Any = None
        self.spill_on_close = False  # a tier that outlives the process (disk): the prefix cache goes there at the end

    def __del__(self) -> None:
        if getattr(self, "spill_on_close", False):  # False too when __init__ refused the model
            try:
                self.spill()
            except Exception:  # interpreter shutdown: the tier's modules may be gone already
                pass

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
        """A layer's stored keys and values, [slots, kv_heads, head_dim] (quantised bytes for a
        quantised ``kv.dtype``: ``layer`` reads them as values)."""
        kv = self._kv[layer]
        return kv.k, kv.v

    def layer(self, layer: int) -> LayerKV:
        """A layer's keys and values (and scales) as attention writes and reads them."""
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
        and the pool's address never changes (a captured CUDA graph writes into it). A quantised
        pool has a second one per device, the scales ([..., kv_heads]), indexed the same way."""
        devices = self.devices or [torch.device("cpu")] * self.layers
        by_device: dict[torch.device, list[int]] = {}
        for layer, device in enumerate(devices):
            if self._attention[layer]:
                by_device.setdefault(torch.device(device), []).append(layer)
        self._stores = []
        slots = self.num_blocks * self.block_size
        fmt = self.format
        for device, layers in by_device.items():
            shape = (len(layers), 2, self.num_blocks, self.block_size, self.kv_heads)
            store = torch.empty(
                (*shape, self.head_dim), dtype=self.dtype if fmt is None else fmt.storage, device=device
            )
            scales = None if fmt is None else torch.empty(shape, dtype=KV_SCALE_DTYPE, device=device)
            self._stores += [store] if scales is None else [store, scales]
            for i, layer in enumerate(layers):
                k, v = (store[i, j].view(slots, self.kv_heads, self.head_dim) for j in (0, 1))
                if scales is None:
                    self._kv[layer] = LayerKV(k, v)
                else:
                    self._kv[layer] = LayerKV(
                        k, v, fmt, scales[i, 0].view(slots, self.kv_heads), scales[i, 1].view(slots, self.kv_heads)
                    )
        self._dirty = [NULL_BLOCK] + self._dirty
        self._allocated = True

    @property
    def stores(self) -> list[torch.Tensor]:
        """The pool's tensors (one per device, and one of scales per device for a quantised pool;
        empty before the first forward), each [layers there, keys/values, blocks, ...]."""
        return list(self._stores)

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every attention layer's key and value views, and scales (what a forward reads and writes)."""
        return [t for kv in self._kv if kv is not None for t in (kv.k, kv.v, kv.k_scale, kv.v_scale) if t is not None]

    # blocks ---------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A block for one sequence (reference count 1): a free one, else the least recently used
        cached block nobody holds (it leaves the prefix cache)."""
        with self.lock:
            if self._free:
                block = self._free.pop()
            elif self._evictable:
                block, _ = self._evictable.popitem(last=False)
                self._offload(block)
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
        """The chain hash of a block: the same in every process (Python's ``hash`` of a string is
        salted per process), so a disk tier written by one server serves the next."""
        return int.from_bytes(hashlib.blake2b(repr((parent, keys)).encode(), digest_size=8).digest(), "little")

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
        """The cached block holding ``keys`` after the chain ``parent`` (held for the caller), or None.
        A block the second tier holds is loaded back into a block of the pool."""
        with self.lock:
            self.lookups += 1
            digest = self.chain(parent, keys)
            block = self._by_digest.get(digest)
            if block is None:
                return self._load(digest, parent, keys)
            entry = self._cached[block]
            if entry.parent != parent or entry.keys != keys:
                return None
            self.hits += 1
            self.hold(block)
            return block

    # second tier ----------------------------------------------------------------------------
    def _offload(self, block: int) -> None:
        """A cached block about to be reused for something else: its bytes to the tier."""
        entry = self._cached[block]
        if self.tier is not None and entry.digest not in self.tier:
            self.tier.put(entry.digest, entry.keys, self.block_blob(block))

    def _load(self, digest: int, parent: int | None, keys: tuple) -> int | None:
        """A block of the pool holding the tier's copy of ``digest`` (held for the caller), or None."""
        if self.tier is None or digest not in self.tier:
            return None
        blob = self.tier.get(digest, keys)
        if blob is None:
            return None
        try:
            block = self.allocate()
        except OutOfBlocks:
            return None
        self.prepare_write()  # a fresh block is zeroed now, not after the bytes go in
        self.load_blob(block, blob)
        self.register(block, parent, keys)
        self.hits += 1
        return block

    def spill(self) -> int:
        """Every full block in the prefix cache to the tier (before a server or chat exits, so a
        disk tier pointed at the same folder starts the next one warm); how many were written."""
        with self.lock:
            if self.tier is None:
                return 0
            todo = [b for b, entry in self._cached.items() if entry.digest not in self.tier]
            for block in todo:
                self._offload(block)
            self.tier.flush()
            return len(todo)

    def block_blob(self, block: int) -> torch.Tensor:
        """A block's bytes in every layer (keys, values, scales) as one uint8 tensor on the CPU."""
        parts = [store[:, :, block].contiguous().view(torch.uint8).reshape(-1) for store in self._stores]
        return torch.cat(parts).cpu() if parts else torch.empty(0, dtype=torch.uint8)

    def load_blob(self, block: int, blob: torch.Tensor) -> None:
        """``block_blob``'s inverse: the bytes into ``block`` of every layer."""
        at = 0
        for store in self._stores:
            target = store[:, :, block]
            n = target.numel() * target.element_size()
            target.copy_(blob[at : at + n].to(store.device).view(store.dtype).view(target.shape))
            at += n

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
