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

**Linear-attention layers** (Qwen3.5) keep a recurrent state per sequence, not per position
(``pipeline.kv.states``): the cache holds the state at its length (``slot``) and **checkpoints**,
states at earlier positions: every ``kv.state_checkpoint_every`` tokens, each prompt's end, its
reply header and last block boundary, and positions asked for with ``checkpoint_at`` (a shared
prefix's end) or by ``snapshot``. Going back in time (``rollback``, ``restore``, ``reuse`` of a shorter
prefix) returns to the nearest checkpoint at or before the position asked for, and the next
prefill recomputes the rest (counted in ``prefill_tokens``): such a cache may end up shorter
than asked, never wrong. Block-boundary checkpoints are registered with the prefix cache, so
another request attaches blocks only up to a position it has a state for.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence


from pipeline.errors import UserError
from pipeline.errors import OutOfBlocks
from pipeline.kv.pool import BlockPool
from pipeline.kv.states import ZERO_SLOT, OutOfSlots, StateIO


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
        # Position state a family needs to continue (e.g. Qwen2-VL rope_deltas); reset with the cache.
        self.state: dict[str, Any] = {}
        # Recurrent states (models with linear-attention layers; see the module docstring).
        self.states = pool.states
        self.slot = ZERO_SLOT  # the state at ``length``
        self.checkpoints: dict[int, int] = {}  # position -> state slot held
        self.wanted: set[int] = set()  # positions to checkpoint when a forward passes them
        self.state_io: StateIO | None = None  # slots the forward being prepared reads and writes
        self._passing: dict[int, int] = {}  # states at every verified draft (held until the next forward)

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
        if self.states is None:
            return kv
        slots = {*self.checkpoints.values(), *self._passing.values(), self.slot} - {ZERO_SLOT}
        return kv + len(slots) * self.states.slot_bytes

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
        io = self._plan_states(n, every_position) if self.states is not None else None
        try:
            slots = self._reserve_blocks(n)
        except OutOfBlocks:
            if io is not None:
                self._drop_io(io)
            raise
        if io is not None:
            self._drop_io(self.state_io)
            self.state_io = io
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
            parent = self._digests[-1] if self._digests else None
            self._digests.append(self.pool.register(self.blocks[i], parent, tuple(self.keys[i * bs : (i + 1) * bs])))
        if self.state_io is not None:
            self._commit(start)
        elif self.states is not None and keys:
            raise RuntimeError("append() without reserve(): the recurrent state did not advance with these keys")

    # --- recurrent states -------------------------------------------------------------------
    def checkpoint_at(self, *positions: int) -> None:
        """Ask for the recurrent state at these positions to be kept when a forward passes them
        (no-op for models without linear-attention layers)."""
        if self.states is not None:
            self.wanted.update(p for p in positions if p > 0)

    def _wants(self, position: int) -> bool:
        every = self.pool.checkpoint_every
        return position in self.wanted or bool(every and position % every == 0)

    def _plan_states(self, n: int, every_position: bool = False) -> StateIO:
        """Slots for a forward over the next ``n`` positions: the state after them (required) and
        checkpoints inside them (taken when a slot is free, else skipped: only recompute is lost)."""
        self._release_passing()
        try:
            target = self.states.allocate()
        except OutOfSlots:
            raise OutOfBlocks from None
        lo, hi, every = self.length, self.length + n, self.pool.checkpoint_every
        inside = {p for p in self.wanted if lo < p < hi}
        if every:
            inside.update(range((lo // every + 1) * every, hi, every))
        passing = set(range(lo + 1, hi)) - inside if every_position else set()
        saves = {}
        for p in sorted(inside | passing):
            try:
                saves[p - lo] = self.states.allocate(optional=p not in passing)
            except OutOfSlots:
                if p in passing:
                    self._drop_io(StateIO(ZERO_SLOT, target, saves))
                    raise OutOfBlocks from None
                continue
        return StateIO(self.slot, target, saves, {p - lo for p in passing})

    def _drop_io(self, io: StateIO | None) -> None:
        if io is not None:
            for slot in (io.target, *io.saves.values()):
                self.states.release(slot)

    def _commit(self, start: int) -> None:
        """The forward's states become the cache's: the new one, and the checkpoints it took."""
        io, self.state_io = self.state_io, None
        for offset, slot in io.saves.items():
            if offset in io.passing:
                self._passing[start + offset] = slot
            else:
                self._keep(start + offset, slot)
        self.states.release(self.slot)
        self.slot = io.target
        if self._wants(self.length):
            self._keep(self.length, self.states.hold(io.target))
        self.wanted = {p for p in self.wanted if p > self.length}

    def _keep(self, position: int, slot: int) -> None:
        """Hold ``slot`` as the checkpoint at ``position``; at a block boundary, also for others."""
        old = self.checkpoints.pop(position, None)
        if old is not None:
            self.states.release(old)
        self.checkpoints[position] = slot
        bs = self.block_size
        if position % bs == 0 and position // bs <= len(self._digests):
            self.states.register(self._digests[position // bs - 1], slot)

    def _restore_state(self, n: int) -> int:
        """Make the state the one at the nearest checkpoint at or before ``n``; return its position."""
        at = n if n == self.length else max([p for p in (*self.checkpoints, *self._passing) if p <= n], default=0)
        if at != self.length:
            for p in [p for p in self.checkpoints if p > at]:
                self.states.release(self.checkpoints.pop(p))
            self.states.release(self.slot)
            self.slot = self.states.hold(self.checkpoints.get(at, self._passing.get(at, ZERO_SLOT)))
            self._release_passing(after=at)
        return at

    def _release_passing(self, after: int = -1) -> None:
        for p in [p for p in self._passing if p > after]:
            self.states.release(self._passing.pop(p))

    # --- reuse and rollback -----------------------------------------------------------------
    def common_prefix(self, keys: Sequence[Hashable]) -> int:
        return shared_prefix_length(self.keys, keys)

    def reuse(self, keys: Sequence[Hashable]) -> int:
        """Keep the longest cached prefix of ``keys`` (this sequence's own, then full blocks from
        the pool's prefix cache); return how many tokens are kept.

        At least one token is always left to compute, because prefill must produce logits.
        """
        limit = len(keys) - 1
        self.rollback(max(0, min(self.common_prefix(keys), limit)))
        if self.states is not None:
            self._attach_with_state(keys, limit)
            return self.length
        bs = self.block_size
        while self.length % bs == 0 and self.length + bs <= limit:
            chunk = tuple(keys[self.length : self.length + bs])
            parent = self._digests[-1] if self._digests else None
            block = self.pool.lookup(parent, chunk)
            if block is None:
                break
            self.blocks.append(block)
            self.keys.extend(chunk)
            self._digests.append(self.pool.digest_of(block))
        return self.length

    def _attach_with_state(self, keys: Sequence[Hashable], limit: int) -> None:
        """Recurrent layers: take blocks from the prefix cache only up to a boundary that has a
        registered state, and only when that goes further than what this cache holds."""
        bs, pool = self.block_size, self.pool
        parent, best = None, 0
        for i in range(limit // bs):
            parent = pool.chain(parent, tuple(keys[i * bs : (i + 1) * bs]))
            if not pool.is_cached(parent):
                break
            if self.states.has(parent):
                best = i + 1
        if best * bs <= self.length:
            return
        blocks, digests, parent = [], [], None
        for i in range(best):
            block = pool.lookup(parent, tuple(keys[i * bs : (i + 1) * bs]))
            if block is None:  # evicted meanwhile by another thread
                break
            blocks.append(block)
            parent = pool.digest_of(block)
            digests.append(parent)
        slot = self.states.lookup(digests[-1]) if len(blocks) == best else None
        if slot is None or best * bs <= self.length:
            for block in blocks:
                pool.release(block)
            if slot is not None:
                self.states.release(slot)
            return
        self.clear()
        self.blocks, self._digests, self.keys = blocks, digests, list(keys[: best * bs])
        self.slot = slot
        self.checkpoints[best * bs] = self.states.hold(slot)
        for i, digest in enumerate(digests[:-1]):  # the registered states before it: for rollbacks
            earlier = self.states.lookup(digest)
            if earlier is not None:
                self.checkpoints[(i + 1) * bs] = earlier

    def future_digests(self, keys: Sequence[Hashable], limit: int | None = None) -> list[int]:
        """Chain hashes of the full blocks of ``keys`` past what this cache holds in full blocks
        (what the prefix cache will know them by once computed); the first ``limit`` of them."""
        bs = self.block_size
        first = self.length // bs
        parent = self._digests[first - 1] if first else None
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
        if self.states is not None:
            n = self._restore_state(n)
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
        self._release_passing()

    def _drop_unrecorded(self) -> None:
        self._release_from(-(-self.length // self.block_size))
        if self.state_io is not None:
            self._drop_io(self.state_io)
            self.state_io = None

    def _release_from(self, index: int) -> None:
        for block in self.blocks[index:]:
            self.pool.release(block)
        del self.blocks[index:]

    def snapshot(self) -> Snapshot:
        """A mark at the current length (with recurrent layers, also a checkpoint there)."""
        if self.states is not None and self.length and self.length not in self.checkpoints:
            self._keep(self.length, self.states.hold(self.slot))
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
        by whichever sequence writes into it first)."""
        other = KVCache(self.pool)
        for block in self.blocks:
            self.pool.hold(block)
        other.blocks = list(self.blocks)
        other.keys = list(self.keys)
        other._digests = list(self._digests)
        other.state = dict(self.state)
        if self.states is not None:  # states are never written in place: share them
            other.slot = self.states.hold(self.slot)
            other.checkpoints = {p: self.states.hold(s) for p, s in self.checkpoints.items()}
            other.wanted = set(self.wanted)
        return other

    def clear(self) -> None:
        self._release_from(0)
        self.keys.clear()
        self._digests.clear()
        self.state.clear()
        if self.states is not None:
            for slot in (self.slot, *self.checkpoints.values()):
                self.states.release(slot)
            self.slot, self.checkpoints = ZERO_SLOT, {}
            self._release_passing()
            self._drop_io(self.state_io)
            self.state_io = None
