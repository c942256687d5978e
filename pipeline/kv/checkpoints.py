"""RecurrentStates: one sequence's recurrent states and their checkpoints (linear-attention layers).

**Linear-attention layers** (Qwen3.5) keep a recurrent state per sequence, not per position
(``pipeline.kv.states``): the cache holds the state at its length (``slot``) and **checkpoints**,
states at earlier positions: every ``kv.state_checkpoint_every`` tokens, each prompt's end, its
reply header and last block boundary, and positions asked for with ``checkpoint_at`` (a shared
prefix's end) or by ``snapshot``. Going back in time (``rollback``, ``restore``, ``reuse`` of a shorter
prefix) returns to the nearest checkpoint at or before the position asked for, and the next
prefill recomputes the rest (counted in ``prefill_tokens``): such a cache may end up shorter
than asked, never wrong. Block-boundary checkpoints are registered with the prefix cache, so
another request attaches blocks only up to a position it has a state for.

A ``KVCache`` (``pipeline.kv.cache``) owns one of these when its pool has state slots and calls
it where its block table changes: ``plan``/``arm`` on reserve, ``commit`` on append, ``restore``
on rollback, ``attach`` on reuse from the prefix cache, ``mark`` on snapshot, ``fork``, ``trim``,
``clear``. It never sees the block table itself: the block hashes it registers checkpoints under
are passed in.
"""

from __future__ import annotations

from typing import Sequence

from pipeline.errors import OutOfBlocks
from pipeline.kv.pool import BlockPool
from pipeline.kv.states import ZERO_SLOT, OutOfSlots, StateIO, StateSlots


class RecurrentStates:
    """The state at a sequence's length, its checkpoints, and the slots of the forward being prepared."""

    def __init__(self, pool: BlockPool) -> None:
        if pool.states is None:
            raise TypeError("RecurrentStates needs a pool with state slots (a model with linear-attention layers)")
        self.pool = pool
        self.states: StateSlots = pool.states
        self.slot = ZERO_SLOT  # the state at the cache's length
        self.checkpoints: dict[int, int] = {}  # position -> state slot held
        self.wanted: set[int] = set()  # positions to checkpoint when a forward passes them
        self.io: StateIO | None = None  # slots the forward being prepared reads and writes
        self._passing: dict[int, int] = {}  # states at every verified draft (held until the next forward)

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct slots held: the state, checkpoints, per-draft states."""
        slots = {*self.checkpoints.values(), *self._passing.values(), self.slot} - {ZERO_SLOT}
        return len(slots) * self.states.slot_bytes

    # --- which positions to keep ------------------------------------------------------------
    def want(self, *positions: int) -> None:
        """Keep the state at these positions when a forward passes them."""
        self.wanted.update(p for p in positions if p > 0)

    def _wants(self, position: int) -> bool:
        every = self.pool.checkpoint_every
        return position in self.wanted or bool(every and position % every == 0)

    # --- a forward: plan, then commit or drop -----------------------------------------------
    def plan(self, start: int, n: int, every_position: bool = False) -> StateIO:
        """Slots for a forward over positions ``start + 1 .. start + n``: the state after them
        (required) and checkpoints inside them (taken when a slot is free, else skipped: only
        recompute is lost); ``every_position``: a state after each (verified drafts), required.
        Raises ``OutOfBlocks`` (the engine treats no slot like no block) with nothing taken."""
        self.release_passing()
        try:
            target = self.states.allocate()
        except OutOfSlots:
            raise OutOfBlocks from None
        hi, every = start + n, self.pool.checkpoint_every
        inside = {p for p in self.wanted if start < p < hi}
        if every:
            inside.update(range((start // every + 1) * every, hi, every))
        passing = set(range(start + 1, hi)) - inside if every_position else set()
        saves = {}
        for p in sorted(inside | passing):
            try:
                saves[p - start] = self.states.allocate(optional=p not in passing)
            except OutOfSlots:
                if p in passing:
                    self.drop(StateIO(ZERO_SLOT, target, saves))
                    raise OutOfBlocks from None
                continue
        return StateIO(self.slot, target, saves, {p - start for p in passing})

    def arm(self, io: StateIO) -> None:
        """Make ``io`` the forward being prepared (replacing one that never ran)."""
        self.drop(self.io)
        self.io = io

    def drop(self, io: StateIO | None) -> None:
        """Give back the slots a planned forward would have written."""
        if io is not None:
            for slot in (io.target, *io.saves.values()):
                self.states.release(slot)

    def cancel(self) -> None:
        """The prepared forward will not be recorded: give its slots back."""
        if self.io is not None:
            self.drop(self.io)
            self.io = None

    def commit(self, start: int, end: int, digests: Sequence[int]) -> None:
        """The forward over ``start .. end`` ran: its states become the sequence's (the new one,
        and the checkpoints it took). ``digests``: the cache's full-block hashes, to register under."""
        if self.io is None:
            if end > start:
                raise RuntimeError("append() without reserve(): the recurrent state did not advance with these keys")
            return
        io, self.io = self.io, None
        for offset, slot in io.saves.items():
            if offset in io.passing:
                self._passing[start + offset] = slot
            else:
                self._keep(start + offset, slot, digests)
        self.states.release(self.slot)
        self.slot = io.target
        if self._wants(end):
            self._keep(end, self.states.hold(io.target), digests)
        self.wanted = {p for p in self.wanted if p > end}

    def _keep(self, position: int, slot: int, digests: Sequence[int]) -> None:
        """Hold ``slot`` as the checkpoint at ``position``; at a block boundary, also for others."""
        old = self.checkpoints.pop(position, None)
        if old is not None:
            self.states.release(old)
        self.checkpoints[position] = slot
        bs = self.pool.block_size
        if position % bs == 0 and position // bs <= len(digests):
            self.states.register(digests[position // bs - 1], slot)

    def mark(self, position: int, digests: Sequence[int]) -> None:
        """A checkpoint at ``position`` (the current length), unless there is one (snapshots)."""
        if position and position not in self.checkpoints:
            self._keep(position, self.states.hold(self.slot), digests)

    # --- going back -------------------------------------------------------------------------
    def restore(self, n: int, length: int) -> int:
        """Make the state the one at the nearest checkpoint at or before ``n`` (the cache holds
        ``length``); return its position: the length the cache can go back to."""
        at = n if n == length else max([p for p in (*self.checkpoints, *self._passing) if p <= n], default=0)
        if at != length:
            for p in [p for p in self.checkpoints if p > at]:
                self.states.release(self.checkpoints.pop(p))
            self.states.release(self.slot)
            self.slot = self.states.hold(self.checkpoints.get(at, self._passing.get(at, ZERO_SLOT)))
            self.release_passing(after=at)
        return at

    def release_passing(self, after: int = -1) -> None:
        """Drop the per-draft states of the last verification past ``after``."""
        for p in [p for p in self._passing if p > after]:
            self.states.release(self._passing.pop(p))

    # --- from the prefix cache ----------------------------------------------------------------
    def registered(self, digest: int) -> bool:
        """Whether the prefix cache has a state after block ``digest``."""
        return self.states.has(digest)

    def lookup(self, digest: int) -> int | None:
        """The registered state after block ``digest``, held for the caller (None: there is none)."""
        return self.states.lookup(digest)

    def attach(self, position: int, slot: int, digests: Sequence[int]) -> None:
        """Start (cleared) from ``slot``, held, the state at ``position`` after the full blocks
        ``digests``; the registered states before it become checkpoints too (for rollbacks)."""
        bs = self.pool.block_size
        self.slot = slot
        self.checkpoints[position] = self.states.hold(slot)
        for i, digest in enumerate(digests[:-1]):
            earlier = self.states.lookup(digest)
            if earlier is not None:
                self.checkpoints[(i + 1) * bs] = earlier

    # --- lifetime ---------------------------------------------------------------------------
    def fork(self) -> RecurrentStates:
        """A second sequence's states: the same slots, shared (a state is never written in place)."""
        other = RecurrentStates(self.pool)
        other.slot = self.states.hold(self.slot)
        other.checkpoints = {p: self.states.hold(s) for p, s in self.checkpoints.items()}
        other.wanted = set(self.wanted)
        return other

    def clear(self) -> None:
        """Back to the empty sequence's state: every slot held is given back (``wanted`` stays)."""
        for slot in (self.slot, *self.checkpoints.values()):
            self.states.release(slot)
        self.slot, self.checkpoints = ZERO_SLOT, {}
        self.release_passing()
        self.drop(self.io)
        self.io = None
