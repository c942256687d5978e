"""KVCache: one sequence's view of the paged KV pool (a block table), which remembers what it holds.

Per cached position it keeps a hashable key: the token id, or for media placeholders
``(token_id, content_hash, index)``, so that two different images with the same number of
placeholder tokens can never match. Its operations are block operations on the shared pool
(``pipeline.kv.pool.BlockPool``):

- ``reuse(keys)``: keep the longest prefix it already holds, then attach full blocks other
  requests left in the pool's prefix cache; Prefill computes only the rest.
- ``rollback(n)``: drop the blocks past ``n`` (a block shared with another sequence or kept in
  the prefix cache is copied before it is written again: copy on write).
- ``snapshot()`` / ``restore(s)``: marks to branch several continuations from one prefix.
- ``fork()``: a second live sequence sharing this one's blocks.

Blocks are reserved (``reserve``) before a forward writes them and recorded (``append``) once it
has; full blocks then enter the prefix cache. Dropping a KVCache returns its blocks.

Models with linear-attention layers (Qwen3.5) also need a recurrent state per sequence, kept
with checkpoints at earlier positions: the cache owns a ``RecurrentStates``
(``pipeline.kv.checkpoints``, which explains them) and calls it wherever the block table
changes. Going back in time there may stop short of the position asked for (at the nearest
checkpoint), and ``reuse`` attaches prefix-cache blocks only up to a position with a state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from pipeline.errors import OutOfBlocks, UserError
from pipeline.kv.checkpoints import RecurrentStates
from pipeline.kv.pool import BlockPool
from pipeline.kv.states import ZERO_SLOT, StateIO, StateSlots


def shared_prefix_length(*sequences: Sequence[Hashable]) -> int:
    """How many leading items all the sequences share (cache keys: ids, media hashes)."""
    if not sequences:
        return 0
    first, n = sequences[0], min(len(s) for s in sequences)
    for other in sequences[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return n


@dataclass(frozen=True)
class Snapshot:
    """A mark to come back to: the length and what the cache held up to it."""

    length: int
    keys: tuple
    state: dict = field(default_factory=dict)


class KVCache:
    """A block table on a ``BlockPool``: reuse, rollback, snapshot/restore, fork, size in bytes."""

    def __init__(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            raise TypeError(f"KVCache needs a BlockPool (Pipeline.new_cache() makes one), got {type(pool).__name__}")
        self.pool = pool
        self.blocks: list[int] = []
        self.keys: list[Hashable] = []
        self._digests: list[int] = []  # chain hash of each full block, in order
        self.root: int | None = None  # the chain's root: None, or a LoRA adapter's (``key_by``)
        # Position state a family needs to continue (e.g. Qwen2-VL rope_deltas); reset with the cache.
        self.state: dict[str, Any] = {}
        # Recurrent states and their checkpoints (models with linear-attention layers only).
        self.recurrent: RecurrentStates | None = RecurrentStates(pool) if pool.states is not None else None

    def __del__(self) -> None:
        try:
            self.clear()
        except Exception:  # interpreter shutdown: the pool may be gone already
            pass

    # --- size -------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return self.length

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks and recurrent states (its own and checkpoints) this sequence holds
        (shared ones count in full for each holder)."""
        kv = len(self.blocks) * self.pool.block_bytes
        return kv if self.recurrent is None else kv + self.recurrent.nbytes

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold: the whole pool."""
        return self.pool.capacity_tokens

    def ensure_capacity(self, needed: int) -> None:
        """Refuse, before any work, a request that could never fit in the pool."""
        if needed > self.capacity:
            raise UserError(
                f"this request needs {needed} tokens of KV cache (prompt + max_new_tokens - 1) but the whole "
                f"pool holds {self.capacity} ({self.pool.num_blocks - 1} blocks of {self.block_size}): "
                "raise kv.memory or lower max_new_tokens"
            )

    # --- writing ----------------------------------------------------------------------------
    def reserve(self, n: int, every_position: bool = False) -> list[int]:
        """Slots for the next ``n`` positions (blocks allocated, a shared partial block copied).

        Raises ``OutOfBlocks`` with nothing changed when the pool cannot give them. With recurrent
        layers it also takes the state slots the forward writes (``state_io``); ``every_position``:
        a state after each of the ``n`` tokens too (verifying drafts: a rollback to any of them
        is then exact), kept only until the next forward.
        """
        rec = self.recurrent
        if rec is None:
            return self._reserve_blocks(n)
        io = rec.plan(self.length, n, every_position)
        try:
            slots = self._reserve_blocks(n)
        except OutOfBlocks:
            rec.drop(io)
            raise
        rec.arm(io)
        return slots

    def _reserve_blocks(self, n: int) -> list[int]:
        bs = self.block_size
        partial = bool(self.length % bs) and bool(self.blocks)
        cow = partial and self.pool.refs[self.blocks[-1]] > 1  # shared (a fork, a prefix hit)
        new: list[int] = []
        try:
            for _ in range(-(-(self.length + n) // bs) - len(self.blocks) + cow):
                new.append(self.pool.allocate())
        except OutOfBlocks:
            for block in new:
                self.pool.release(block)
            raise
        if cow:  # copy on write: the other holders keep the original
            copy = new.pop(0)
            self.pool.copy_block(self.blocks[-1], copy)
            self.pool.release(self.blocks[-1])
            self.blocks[-1] = copy
        elif partial:
            self.pool.unregister(self.blocks[-1])  # ours alone: its cached content is about to change
        self.blocks.extend(new)
        blocks = self.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(self.length, self.length + n)]

    def append(self, keys: Sequence[Hashable]) -> None:
        """Record what the model just wrote into the reserved slots; full blocks enter the prefix cache."""
        start = self.length
        self.keys.extend(keys)
        bs = self.block_size
        for i in range(len(self._digests), self.length // bs):
            parent = self._digests[-1] if self._digests else self.root
            self._digests.append(self.pool.register(self.blocks[i], parent, tuple(self.keys[i * bs : (i + 1) * bs])))
        if self.recurrent is not None:
            self.recurrent.commit(start, self.length, self._digests)

    # --- recurrent states (``pipeline.kv.checkpoints``) ----------------------------------------
    @property
    def states(self) -> StateSlots | None:
        """The pool's recurrent-state slots (None: no linear-attention layers)."""
        return self.pool.states

    @property
    def slot(self) -> int:
        """The recurrent state at ``length``."""
        return ZERO_SLOT if self.recurrent is None else self.recurrent.slot

    @property
    def checkpoints(self) -> dict[int, int]:
        """Position -> recurrent-state slot held there."""
        return {} if self.recurrent is None else self.recurrent.checkpoints

    @property
    def wanted(self) -> set[int]:
        """Positions to checkpoint when a forward passes them."""
        return set() if self.recurrent is None else self.recurrent.wanted

    @property
    def state_io(self) -> StateIO | None:
        """The state slots the forward being prepared reads and writes (read by intake)."""
        return None if self.recurrent is None else self.recurrent.io

    def checkpoint_at(self, *positions: int) -> None:
        """Ask for the recurrent state at these positions to be kept when a forward passes them
        (no-op for models without linear-attention layers)."""
        if self.recurrent is not None:
            self.recurrent.want(*positions)

    # --- reuse and rollback -----------------------------------------------------------------
    def common_prefix(self, keys: Sequence[Hashable]) -> int:
        return shared_prefix_length(self.keys, keys)

    def key_by(self, root: int | None) -> None:
        """Chain this sequence's blocks from ``root`` (a LoRA adapter's: ``Adapter.root``): keys
        and values computed under one adapter are found again only under it. A cache holding
        blocks of another root is emptied first."""
        if root != self.root:
            self.clear()
            self.root = root

    def reuse(self, keys: Sequence[Hashable]) -> int:
        """Keep the longest cached prefix of ``keys`` (this sequence's own, then full blocks from
        the pool's prefix cache); return how many tokens are kept.

        At least one token is always left to compute, because prefill must produce logits.
        """
        limit = len(keys) - 1
        self.rollback(max(0, min(self.common_prefix(keys), limit)))
        if self.recurrent is not None:
            self._attach_with_state(self.recurrent, keys, limit)
            return self.length
        bs = self.block_size
        while self.length % bs == 0 and self.length + bs <= limit:
            chunk = tuple(keys[self.length : self.length + bs])
            parent = self._digests[-1] if self._digests else self.root
            block = self.pool.lookup(parent, chunk)
            if block is None:
                break
            self.blocks.append(block)
            self.keys.extend(chunk)
            self._digests.append(self.pool.digest_of(block))
        return self.length

    def _attach_with_state(self, rec: RecurrentStates, keys: Sequence[Hashable], limit: int) -> None:
        """Recurrent layers: take blocks from the prefix cache only up to a boundary that has a
        registered state, and only when that goes further than what this cache holds."""
        best = self._boundary_with_state(rec, keys, limit)
        if best * self.block_size <= self.length:
            return
        blocks, digests = self._lookup_blocks(keys, best)
        slot = rec.lookup(digests[-1]) if len(blocks) == best else None
        if slot is None:  # a block or its state was evicted meanwhile by another thread
            for block in blocks:
                self.pool.release(block)
            return
        self.clear()
        self.blocks, self._digests, self.keys = blocks, digests, list(keys[: best * self.block_size])
        rec.attach(best * self.block_size, slot, digests)

    def _boundary_with_state(self, rec: RecurrentStates, keys: Sequence[Hashable], limit: int) -> int:
        """Full blocks of ``keys`` (within ``limit``) up to the last cached one with a registered state."""
        bs, parent, best = self.block_size, self.root, 0
        for i in range(limit // bs):
            parent = self.pool.chain(parent, tuple(keys[i * bs : (i + 1) * bs]))
            if not self.pool.is_cached(parent):
                break
            if rec.registered(parent):
                best = i + 1
        return best

    def _lookup_blocks(self, keys: Sequence[Hashable], count: int) -> tuple[list[int], list[int]]:
        """The first ``count`` full blocks of ``keys`` from the prefix cache, held, with their
        hashes; fewer if one was evicted meanwhile by another thread."""
        bs, blocks, digests, parent = self.block_size, [], [], self.root
        for i in range(count):
            block = self.pool.lookup(parent, tuple(keys[i * bs : (i + 1) * bs]))
            if block is None:
                break
            blocks.append(block)
            parent = self.pool.digest_of(block)
            digests.append(parent)
        return blocks, digests

    def future_digests(self, keys: Sequence[Hashable], limit: int | None = None) -> list[int]:
        """Chain hashes of the full blocks of ``keys`` past what this cache holds in full blocks
        (what the prefix cache will know them by once computed); the first ``limit`` of them."""
        bs = self.block_size
        first = self.length // bs
        parent = self._digests[first - 1] if first else self.root
        out = []
        last = len(keys) // bs if limit is None else min(len(keys) // bs, first + limit)
        for i in range(first, last):
            parent = self.pool.chain(parent, tuple(keys[i * bs : (i + 1) * bs]))
            out.append(parent)
        return out

    def rollback(self, n: int) -> int:
        """Return to length ``n`` (drop everything after it); returns the length reached. With
        recurrent layers that is the nearest checkpoint at or before ``n`` (the next prefill
        recomputes the rest)."""
        if n < 0 or n > self.length:
            raise ValueError(f"cannot roll back to {n}: the cache holds {self.length} tokens")
        if self.recurrent is not None:
            n = self.recurrent.restore(n, self.length)
        if n == 0:
            self.clear()
            return 0
        del self.keys[n:]
        del self._digests[n // self.block_size :]
        self._drop_unrecorded()  # (a verification's per-draft states up to n stay until the next forward)
        return n

    def trim(self) -> None:
        """Return blocks (and state slots) past the recorded keys, reserved for a forward that did
        not finish, and the per-draft states of the last verification."""
        self._drop_unrecorded()
        if self.recurrent is not None:
            self.recurrent.release_passing()

    def _drop_unrecorded(self) -> None:
        self._release_from(-(-self.length // self.block_size))
        if self.recurrent is not None:
            self.recurrent.cancel()

    def _release_from(self, index: int) -> None:
        for block in self.blocks[index:]:
            self.pool.release(block)
        del self.blocks[index:]

    def snapshot(self) -> Snapshot:
        """A mark at the current length (with recurrent layers, also a checkpoint there)."""
        if self.recurrent is not None:
            self.recurrent.mark(self.length, self._digests)
        return Snapshot(self.length, tuple(self.keys), dict(self.state))

    def restore(self, snap: Snapshot) -> None:
        """Roll back to a snapshot taken on this cache; its prefix must still be what it held
        (recurrent layers: to its checkpoint, or the nearest one before it if that was dropped)."""
        if self.length < snap.length or tuple(self.keys[: snap.length]) != snap.keys:
            raise ValueError("snapshot no longer matches the cache (it was cleared or overwritten)")
        self.rollback(snap.length)
        self.state = dict(snap.state)

    def fork(self) -> "KVCache":
        """A second sequence holding the same blocks (no copy; a shared partial block is copied
        by whichever sequence writes into it first) and the same recurrent states."""
        other = KVCache(self.pool)
        other.root = self.root
        for block in self.blocks:
            self.pool.hold(block)
        other.blocks = list(self.blocks)
        other.keys = list(self.keys)
        other._digests = list(self._digests)
        other.state = dict(self.state)
        if self.recurrent is not None:
            other.recurrent = self.recurrent.fork()
        return other

    def clear(self) -> None:
        """Back to empty, every block and state slot given back (also when the cache is dropped)."""
        self._release_from(0)
        self.keys.clear()
        self._digests.clear()
        self.state.clear()
        if self.recurrent is not None:
            self.recurrent.clear()
