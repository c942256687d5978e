"""The scheduler: which sequences run this step and which tokens each feeds. Host-only.

It sees sequences (``pipeline.engine.sequence``), their caches' block tables and the pool's
free blocks, never a tensor or the model, so it is tested on its own (``tests/test_scheduler.py``).

- **Admission**: waiting sequences join the running set by priority (``Request.priority``,
  lower first), then in arrival order, while there are places (``max_seqs``) and blocks for
  their prompt plus headroom; a waiting sequence that finds neither preempts running ones of a
  lower priority (a higher value), the most recently admitted first. A sequence whose next block
  another running sequence is computing right now waits until that prefill is done, then takes
  it from the prefix cache: requests that share a system prompt or an image, arriving together,
  compute it once.
- **Scheduling**: decode tokens first (one per decoding sequence), then prefill chunks of the
  others in admission order, under the token budget (``max_batch_tokens``).
- **Preemption**: a sequence that cannot get blocks takes them from the lowest-priority, then
  most recently admitted, sequence not yet scheduled in this step (it may be itself): that one's
  blocks go back, and it waits at the head of its priority in the queue to recompute (mostly
  prefix-cache hits) with its output unchanged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from pipeline.engine.sequence import Sequence, Status
from pipeline.errors import OutOfBlocks, UserError, whole_number


@dataclass
class Scheduled:
    """One sequence's part of a step: tokens [begin, end) then its drafts, written to ``slots``."""

    seq: Sequence
    begin: int
    end: int
    slots: list[int]

    @property
    def count(self) -> int:
        return self.end - self.begin + len(self.seq.drafts)


class Scheduler:
    """Waiting and running sequences over one block pool (``pool``: ``free_blocks``,
    ``block_size``, ``states``); ``failed`` collects (sequence, error) for the engine to end."""

    def __init__(self, pool: Any, max_seqs: int = 8, max_batch_tokens: int = 2048) -> None:
        self.pool = pool
        self.max_seqs = whole_number("engine.max_seqs", max_seqs)
        self.max_batch_tokens = whole_number("engine.max_batch_tokens", max_batch_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.failed: list[tuple[Sequence, BaseException]] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        """Into the waiting queue by priority; among equals at the back (a new request) or at the
        front (a preempted one: it recomputes first)."""
        for i, other in enumerate(self.waiting):
            if other.priority > seq.priority or (front and other.priority == seq.priority):
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        self.remove(seq)
        self.failed.append((seq, err))

    # --- admission ----------------------------------------------------------------------------
    def admit(self, prepare: Callable[[Sequence], None], started: Callable[[Sequence], None]) -> None:
        """Move waiting sequences into the running set while there is room. ``prepare`` runs a
        new sequence's front stages (its error fails that sequence alone); ``started`` is told
        of a sequence's first admission."""
        computing = self._computing()
        for seq in list(self.waiting):
            if not self._seat_free() and not any(s.priority > seq.priority for s in self.running):
                return  # every place taken, by none it outranks
            if not self._ready(seq, prepare):
                continue
            upcoming = seq.cache.future_digests(seq.keys[: seq.prompt_len], limit=1)
            if upcoming and upcoming[0] in computing and seq.cache.length % self.pool.block_size == 0:
                continue  # deferred: another sequence is computing its next block
            if not self._make_way(seq, self._seat_free):  # only now, when it is ready to run
                return
            if self.running and not self._room_for(seq) and not self._make_way(seq, lambda: self._room_for(seq)):
                return  # new requests wait for blocks (and state slots) to come back
            if not seq.started:
                seq.started = True
                started(seq)
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = Status.RUNNING
            if seq.cache.length < seq.prompt_len:
                computing.update(seq.cache.future_digests(seq.keys[: seq.prompt_len]))

    def none_admissible(self) -> bool:
        """No waiting sequence could be admitted before a running one ends: none waits, or every
        place is taken by sequences none of the waiting outranks (``Request.priority``)."""
        if not self.waiting:
            return True
        if self._seat_free():
            return False
        best = min(s.priority for s in self.waiting)
        return not any(s.priority > best for s in self.running)

    def _seat_free(self) -> bool:
        return len(self.running) < self.max_seqs

    def _make_way(self, seq: Sequence, enough: Callable[[], bool]) -> bool:
        """Preempt running sequences of a lower priority than ``seq`` (the lowest, then the most
        recently admitted, first) until ``enough()``; whether it now holds."""
        while not enough():
            lower = [s for s in self.running if s.priority > seq.priority]
            if not lower:
                return False
            self.preempt(self._victim(lower))
        return True

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        """The one to preempt: the lowest priority (highest value), then the most recently admitted."""
        return max(candidates, key=lambda s: (s.priority, self.running.index(s)))

    def _computing(self) -> set[int]:
        """Chain hashes of the prompt blocks running sequences are computing now. (Recurrent
        layers: a block is of use only with a state at its end, so nobody waits for one.)"""
        if self.pool.states is not None:
            return set()
        return {
            d
            for s in self.running
            if s.cache.length < s.prompt_len
            for d in s.cache.future_digests(s.keys[: s.prompt_len])
        }

    def _ready(self, seq: Sequence, prepare: Callable[[Sequence], None]) -> bool:
        """Prepare a new sequence, or let a readmitted one take what the prefix cache has now."""
        if not seq.prepared:
            if seq.grammar is not None and not seq.grammar.ready:
                return False  # its grammar is compiling (off the step): the others go ahead
            try:
                prepare(seq)
            except BaseException as err:
                self._fail(seq, err)
                return False
            return True
        before = seq.cache.length
        seq.cache.reuse(seq.reusable(seq.keys[: seq.known]))
        if not seq.started and seq.cache.length != before:
            seq.ctx.metrics.set("kv_reused_tokens", seq.cache.length)
        return True

    def _room_for(self, seq: Sequence) -> bool:
        """Blocks for its prompt, plus headroom for the running ones to grow (else it is admitted
        only to be preempted at the next block boundary), and two state slots if the model has them."""
        need = -(-(seq.known - seq.cache.length) // self.pool.block_size) + 1 + len(self.running) // 8
        states = self.pool.states
        return self.pool.free_blocks >= need and (states is None or states.free_slots >= 2)

    # --- one step's plan ----------------------------------------------------------------------
    def schedule(self, draft: Callable[[Sequence, int], None]) -> list[Scheduled]:
        """This step's chunks: decode tokens first, then prefill chunks, under the token budget.
        ``draft(seq, budget)``: asked for a decoding sequence's drafts (speculative decoding)."""
        budget = self.max_batch_tokens
        order = sorted(self.running, key=lambda s: s.cache.length < s.prompt_len or s.known - s.cache.length > 1)
        plan: list[Scheduled] = []
        for seq in order:
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            begin, end = self.next_chunk(seq, budget)
            if end <= begin:
                continue
            if seq.spec is not None:
                seq.spec.drafts, seq.spec.q = [], None
                if end - begin == 1 and begin >= seq.prompt_len and not seq.prefill_only:
                    draft(seq, budget)
            slots = self._reserve(seq, end - begin + len(seq.drafts), plan)
            if slots is None:
                continue
            plan.append(Scheduled(seq, begin, end, slots))
            budget -= plan[-1].count
            if budget <= 0:
                break
        if not plan and self.running and not self.waiting:
            raise RuntimeError("engine stalled: running sequences but nothing to schedule")
        return plan

    def next_chunk(self, seq: Sequence, budget: int) -> tuple[int, int]:
        """[begin, end) of the tokens ``seq`` feeds next within ``budget`` (end == begin: nothing).

        Prefill (and recompute after a preemption) goes in chunks the prefill stage plans
        (``Prefill.plan_chunk``). A chunk never ends inside a bidirectional span
        (``Family.bidirectional_spans``): the span's queries before the cut would miss its later
        keys. The cut moves back to the span's start, or, when the chunk begins at (or inside)
        the span, on to its end, so such a chunk may run past the plan by up to one span.
        """
        begin = seq.cache.length
        todo = seq.known - begin
        if (todo > 1 or begin < seq.prompt_len) and seq.phases.prefill is not None:
            todo = seq.phases.prefill.plan_chunk(seq.ctx, begin, todo)
        end = begin + max(0, min(todo, budget))
        for start, stop in seq.layout.spans:
            if start < end < stop and end > begin:
                end = start if start > begin else stop
                break
        return begin, end

    def _reserve(self, seq: Sequence, n: int, plan: list[Scheduled]) -> list[int] | None:
        """Slots for ``n`` tokens of ``seq``, preempting others (or ``seq`` itself) for blocks;
        None when ``seq`` was preempted."""
        scheduled = {id(s.seq) for s in plan}
        while True:
            try:
                return seq.cache.reserve(n, every_position=bool(seq.drafts))
            except OutOfBlocks:
                candidates = [s for s in self.running if id(s) not in scheduled]
                victim = self._victim(candidates) if candidates else seq
                self.preempt(victim)
                if victim is seq:
                    return None

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it recomputes later from the head of the queue."""
        self.running.remove(seq)
        seq.cache.clear()
        seq.status = Status.WAITING
        self._enqueue(seq, front=True)
        self.preemptions += 1
        seq.ctx.metrics.count("preemptions")
        states = self.pool.states
        if not self.running and (
            self.pool.free_blocks < -(-seq.known // self.pool.block_size)
            or (states is not None and states.free_slots == 0)
        ):
            self._fail(seq, UserError("the KV pool is full of blocks held by other caches: raise kv.memory"))
