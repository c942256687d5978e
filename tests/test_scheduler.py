"""The scheduler on its own, host-only: fake pool, fake per-sequence caches, real Sequences.

What a user relies on: requests are admitted in order under ``max_seqs`` and the token budget,
prefill goes in the chunks its stage plans and never cuts a bidirectional span, requests sharing
a prompt prefix compute it once, a request that runs out of blocks is preempted and recomputes
first, every request finishes on a tiny pool, and one that can never fit fails alone with a
message saying what to raise. No torch, no model: a step here is "the forward wrote the fed
tokens, and a token was generated where the chunk reached the known tokens".
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.engine.scheduler import Scheduled, Scheduler
from pipeline.engine.sequence import Layout, Phases, Sequence, Status
from pipeline.errors import OutOfBlocks, UserError


# --- fakes --------------------------------------------------------------------------------------
class FakePool:
    """Blocks with reference counts and a prefix cache (chain hash -> block). A cached block nobody
    holds counts as free (evictable), as in BlockPool."""

    def __init__(self, num_blocks: int, block_size: int = 4) -> None:
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.cached: dict[int, int] = {}  # digest -> block
        self.digest: dict[int, int] = {}  # block -> digest
        self.states = None

    @property
    def free_blocks(self) -> int:
        return self.refs.count(0)

    def allocate(self) -> int:
        free = [b for b, r in enumerate(self.refs) if r == 0]
        if not free:
            raise OutOfBlocks
        block = min(free, key=lambda b: b in self.digest)  # uncached first, then evict
        if block in self.digest:
            del self.cached[self.digest.pop(block)]
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, block: int) -> None:
        assert self.refs[block] > 0, "released a block nobody holds"
        self.refs[block] -= 1

    @staticmethod
    def chain(parent: int | None, keys: tuple) -> int:
        return hash((parent, keys))

    def register(self, block: int, digest: int) -> None:
        if digest not in self.cached and block not in self.digest:
            self.cached[digest] = block
            self.digest[block] = digest


class FakeCache:
    """What the scheduler calls on a KVCache, over FakePool: block table, keys, chain hashes."""

    def __init__(self, pool: FakePool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.keys: list = []
        self.digests: list[int] = []
        self.reserved = 0  # positions reserved past ``length`` for the step in flight

    @property
    def length(self) -> int:
        return len(self.keys)

    def reserve(self, n: int, every_position: bool = False) -> list[int]:
        bs = self.pool.block_size
        need = -(-(self.length + n) // bs) - len(self.blocks)
        if need > self.pool.free_blocks:
            raise OutOfBlocks  # nothing changed
        for _ in range(need):
            self.blocks.append(self.pool.allocate())
        self.reserved = n
        return [self.blocks[p // bs] * bs + p % bs for p in range(self.length, self.length + n)]

    def append(self, keys: list) -> None:
        """The forward wrote these (reserved) positions; full blocks enter the prefix cache."""
        assert len(keys) <= self.reserved, "wrote positions that were not reserved"
        self.reserved = 0
        self.keys.extend(keys)
        bs = self.pool.block_size
        for i in range(len(self.digests), self.length // bs):
            parent = self.digests[-1] if self.digests else None
            self.digests.append(self.pool.chain(parent, tuple(self.keys[i * bs : (i + 1) * bs])))
            self.pool.register(self.blocks[i], self.digests[-1])

    def clear(self) -> None:
        for block in self.blocks:
            self.pool.release(block)
        self.blocks, self.keys, self.digests, self.reserved = [], [], [], 0

    def reuse(self, keys: list) -> int:
        """Keep the held prefix of ``keys``, then attach full blocks from the prefix cache (at
        least one token is left to compute)."""
        bs, limit = self.pool.block_size, len(keys) - 1
        same = next((i for i, (a, b) in enumerate(zip(self.keys, keys)) if a != b), min(len(self.keys), len(keys)))
        keep = min(same, limit) // bs
        if keep * bs < self.length:  # (a whole-block rollback is enough here)
            for block in self.blocks[keep:]:
                self.pool.release(block)
            del self.blocks[keep:], self.keys[keep * bs :], self.digests[keep:]
        while self.length % bs == 0 and self.length + bs <= limit and len(self.blocks) == len(self.digests):
            parent = self.digests[-1] if self.digests else None
            chunk = tuple(keys[self.length : self.length + bs])
            block = self.pool.cached.get(self.pool.chain(parent, chunk))
            if block is None:
                break
            self.pool.hold(block)
            self.blocks.append(block)
            self.keys.extend(chunk)
            self.digests.append(self.pool.digest[block])
        return self.length

    def future_digests(self, keys: list, limit: int | None = None) -> list[int]:
        bs = self.pool.block_size
        first = self.length // bs
        parent = self.digests[first - 1] if first else None
        last = len(keys) // bs if limit is None else min(len(keys) // bs, first + limit)
        out = []
        for i in range(first, last):
            parent = self.pool.chain(parent, tuple(keys[i * bs : (i + 1) * bs]))
            out.append(parent)
        return out


class FakeMetrics:
    def __init__(self) -> None:
        self.values: dict = {}
        self.counts: dict = {}

    def set(self, name, value) -> None:
        self.values[name] = value

    def count(self, name) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1


class ChunkPlanner:
    """The prefill stage's ``plan_chunk`` hook: at most ``limit`` tokens a chunk (None: all)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.calls: list[tuple] = []

    def plan_chunk(self, ctx, start: int, todo: int) -> int:
        self.calls.append((ctx, start, todo))
        return todo if self.limit is None else min(todo, self.limit)


def make_seq(
    pool: FakePool,
    prompt: list,
    max_new: int = 3,
    chunk: int | None = None,
    spans: list[tuple[int, int]] = (),
    prepared: bool = True,
    name: str = "",
) -> Sequence:
    ctx = SimpleNamespace(cache=FakeCache(pool), metrics=FakeMetrics(), name=name)
    seq = Sequence(ctx=ctx, phases=Phases(prefill=ChunkPlanner(chunk)))
    seq.ids, seq.keys, seq.prompt_len = list(prompt), list(prompt), len(prompt)
    seq.max_new = max_new  # (test bookkeeping: the fake runner ends it after this many tokens)
    if prepared:
        seq.layout = Layout(rows=[list(range(len(prompt)))], offsets=[0], spans=list(spans))
    return seq


def prepare(seq: Sequence) -> None:
    """intake.prepare's part the scheduler depends on: layout set, the prefix cache consulted."""
    seq.layout = Layout(rows=[list(range(seq.prompt_len))], offsets=[0], spans=[])
    seq.cache.reuse(seq.keys[: seq.prompt_len])


class FakeEngine:
    """The engine's loop over a Scheduler, with the forward replaced by bookkeeping."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.started: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.steps: list[list[tuple[Sequence, int, int]]] = []  # per step: (seq, begin, end)

    def step(self) -> list[Scheduled]:
        self.sched.admit(prepare, self.started.append)
        plan = self.sched.schedule(draft=lambda s, b: None)
        # the budget holds, except that a chunk goes on to the end of a span it starts in
        over = max((stop - start for i in plan for start, stop in i.seq.layout.spans), default=0)
        assert sum(item.count for item in plan) <= self.sched.max_batch_tokens + over
        self.steps.append([(item.seq, item.begin, item.end) for item in plan])
        for item in plan:
            seq = item.seq
            assert item.begin == seq.cache.length and len(item.slots) == item.end - item.begin
            seq.cache.append(seq.keys[item.begin : item.end])
            if item.end == seq.known:  # logits at the last known token: one more token
                token = 1000 + len(seq.ids)  # a function of the position: recompute changes nothing
                seq.ids.append(token)
                seq.keys.append(token)
                if seq.known - seq.prompt_len >= seq.max_new:
                    self.sched.remove(seq)
                    seq.status = Status.FINISHED
                    seq.cache.clear()
                    self.finished.append(seq)
        return plan

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        left = [s.ctx.name for s in (*self.sched.waiting, *self.sched.running)]
        raise AssertionError(f"not done after {max_steps} steps (starving: {left})")

    def fed(self, seq: Sequence) -> list[tuple[int, int]]:
        return [(b, e) for step in self.steps for s, b, e in step if s is seq]


def prompt_of(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# --- admission ----------------------------------------------------------------------------------
def test_max_seqs_admits_in_arrival_order_and_the_next_when_one_ends():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=2, max_batch_tokens=64)
    seqs = [make_seq(pool, prompt_of(5, 100 * i), max_new=2 + i, name=f"s{i}") for i in range(4)]
    for s in seqs:
        sched.add(s)
    eng = FakeEngine(sched)
    eng.step()
    assert sched.running == seqs[:2] and list(sched.waiting) == seqs[2:]
    assert all(s.status is Status.WAITING for s in seqs[2:])
    eng.step()  # s0 (2 tokens) ends here
    assert eng.finished == [seqs[0]]
    eng.step()
    assert seqs[2] in sched.running and list(sched.waiting) == [seqs[3]]
    eng.run()
    assert eng.started == seqs  # each started once, in arrival order
    assert [s.known - s.prompt_len for s in seqs] == [s.max_new for s in seqs]
    assert not sched.failed


def test_a_new_request_waits_for_blocks_instead_of_being_admitted_to_be_preempted():
    pool = FakePool(6)
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=64)
    a = make_seq(pool, prompt_of(16), max_new=4, name="a")  # 4 blocks, a 5th for its tokens
    b = make_seq(pool, prompt_of(8, 100), max_new=2, name="b")  # 2 blocks, + 1 of headroom
    sched.add(a)
    eng = FakeEngine(sched)
    eng.step()
    sched.add(b)
    while a not in eng.finished:
        assert sched.running == [a] and list(sched.waiting) == [b]
        eng.step()
    eng.run()
    assert eng.finished == [a, b] and sched.preemptions == 0


def test_a_request_whose_front_stages_fail_fails_alone():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=64)
    bad, good = make_seq(pool, prompt_of(5), prepared=False), make_seq(pool, prompt_of(5, 50), prepared=False)
    sched.add(bad)
    sched.add(good)
    err = UserError("image not found")

    def prep(seq):
        if seq is bad:
            raise err
        prepare(seq)

    sched.admit(prep, lambda s: None)
    assert sched.failed == [(bad, err)]
    assert sched.running == [good] and not sched.waiting


# --- one step's plan: budget, decode first, chunks, spans ---------------------------------------
def test_token_budget_splits_prefill_and_decode_tokens_come_first():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=8)
    a, b = make_seq(pool, prompt_of(20), max_new=4), make_seq(pool, prompt_of(20, 100), max_new=4)
    sched.add(a)
    sched.add(b)
    eng = FakeEngine(sched)
    for _ in range(4):
        eng.step()
    split = [[(s is a and "a" or "b", e - bg) for s, bg, e in step] for step in eng.steps]
    # a's prompt in budget-sized chunks, b gets what is left; then a decodes (1 token) before b's chunk
    assert split == [[("a", 8)], [("a", 8)], [("a", 4), ("b", 4)], [("a", 1), ("b", 7)]]


def test_a_decoding_sequence_is_scheduled_before_one_admitted_earlier_that_prefills():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=8)
    long = make_seq(pool, prompt_of(30), chunk=2)  # its prefill stage plans 2-token chunks
    short = make_seq(pool, prompt_of(5, 100))
    sched.add(long)
    sched.add(short)
    eng = FakeEngine(sched)
    first = eng.step()
    assert [(i.seq, i.begin, i.end) for i in first] == [(long, 0, 2), (short, 0, 5)]
    second = eng.step()
    assert [(i.seq, i.begin, i.end) for i in second] == [(short, 5, 6), (long, 2, 4)]


def test_prefill_goes_in_the_chunks_the_prefill_stage_plans():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=64)
    seq = make_seq(pool, prompt_of(12), max_new=3, chunk=5)
    sched.add(seq)
    eng = FakeEngine(sched)
    eng.run()
    assert eng.fed(seq) == [(0, 5), (5, 10), (10, 12), (12, 13), (13, 14)]
    # asked with (ctx, start, tokens left) for each prefill chunk; decode steps do not ask
    assert seq.phases.prefill.calls == [(seq.ctx, 0, 12), (seq.ctx, 5, 7), (seq.ctx, 10, 2)]


def test_a_chunk_never_ends_inside_a_bidirectional_span():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=64)
    seq = make_seq(pool, prompt_of(12), max_new=1, chunk=5, spans=[(3, 9)])
    sched.add(seq)
    eng = FakeEngine(sched)
    eng.run()
    # 5 would cut the span: back to its start; from its start, on to its end (past the plan)
    assert eng.fed(seq) == [(0, 3), (3, 9), (9, 12)]


def test_a_span_is_not_cut_by_the_token_budget_either():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=4)
    seq = make_seq(pool, prompt_of(10), max_new=1, spans=[(2, 8)])
    sched.add(seq)
    eng = FakeEngine(sched)
    eng.run()
    # the budget cuts before the span, and a span longer than the budget goes whole (in 4 it
    # never could): the one case a step feeds more than max_batch_tokens
    assert eng.fed(seq) == [(0, 2), (2, 8), (8, 10)]


# --- shared prefixes ----------------------------------------------------------------------------
def test_a_request_waits_for_the_prefix_block_another_is_computing_then_reuses_it():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=64)
    shared = prompt_of(12, 500)  # three full blocks of 4
    a = make_seq(pool, shared + [1, 2], chunk=4, prepared=False, name="a")
    b = make_seq(pool, shared + [3, 4], chunk=4, prepared=False, name="b")
    sched.add(a)
    sched.add(b)
    eng = FakeEngine(sched)
    for _ in range(3):  # a computes the shared blocks one per step; b waits
        eng.step()
        assert sched.running == [a] and list(sched.waiting) == [b]
        assert b.prepared and b.status is Status.WAITING and eng.started == [a]
    assert a.cache.length == 12
    eng.step()  # now b is admitted with the three blocks from the prefix cache
    assert b in sched.running and eng.started == [a, b]
    assert eng.fed(b) == [(12, 14)]
    assert b.ctx.metrics.values["kv_reused_tokens"] == 12
    assert b.cache.blocks[:3] == a.cache.blocks[:3]  # the same blocks, computed once
    eng.run()
    assert {id(s) for s in eng.finished} == {id(a), id(b)}


def test_a_request_with_a_different_prefix_does_not_wait():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=64)
    a = make_seq(pool, prompt_of(14, 500), chunk=4, prepared=False)
    b = make_seq(pool, prompt_of(14, 900), chunk=4, prepared=False)
    sched.add(a)
    sched.add(b)
    eng = FakeEngine(sched)
    eng.step()
    assert sched.running == [a, b] and eng.fed(b) == [(0, 4)]


# --- preemption ---------------------------------------------------------------------------------
def test_out_of_blocks_preempts_the_latest_admitted_which_recomputes_first():
    pool = FakePool(6)  # 24 tokens; a and b need 5 blocks each by their end
    sched = Scheduler(pool, max_seqs=2, max_batch_tokens=64)
    a = make_seq(pool, prompt_of(8), max_new=12, name="a")
    b = make_seq(pool, prompt_of(8, 100), max_new=12, name="b")
    c = make_seq(pool, prompt_of(4, 200), max_new=1, name="c")
    for s in (a, b, c):
        sched.add(s)
    eng = FakeEngine(sched)
    while not sched.preemptions:
        eng.step()
    # b lost its blocks to a: it waits at the head of the queue (before c), its tokens kept
    assert sched.preemptions == 1 and b.ctx.metrics.counts == {"preemptions": 1}
    assert list(sched.waiting) == [b, c] and sched.running == [a]
    assert b.status is Status.WAITING and b.cache.length == 0 and b.cache.blocks == []
    generated = b.ids[b.prompt_len :]
    assert generated and b.known == b.prompt_len + len(generated)
    preempted_at = len(eng.steps)
    eng.run()
    assert not sched.failed and len(eng.finished) == 3
    after = [step for step in eng.steps[preempted_at:]]
    first_b = next(i for i, step in enumerate(after) if any(s is b for s, _, _ in step))
    first_c = next(i for i, step in enumerate(after) if any(s is c for s, _, _ in step))
    assert first_b <= first_c
    # b recomputes everything it knew (prompt and generated tokens) before generating more
    recompute = next((bg, e) for s, bg, e in after[first_b] if s is b)
    assert recompute[1] == b.prompt_len + len(generated) and recompute[0] < recompute[1] - 1
    assert b.ids[: b.prompt_len + len(generated)] == prompt_of(8, 100) + generated
    assert eng.started.count(b) == 1  # re-admission is not a new start (queue_s kept)


def prioritised(seq: Sequence, priority: int) -> Sequence:
    seq.ctx.request = SimpleNamespace(priority=priority)
    return seq


def test_waiting_requests_queue_by_priority_then_arrival():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=1, max_batch_tokens=64)
    seqs = [prioritised(make_seq(pool, prompt_of(4, 100 * i), name=f"s{i}"), p) for i, p in enumerate([3, 1, 2, 1])]
    for seq in seqs:
        sched.add(seq)
    assert [s.ctx.name for s in sched.waiting] == ["s1", "s3", "s2", "s0"]
    eng = FakeEngine(sched)
    eng.run()
    assert [s.ctx.name for s in eng.finished] == ["s1", "s3", "s2", "s0"]


def test_a_waiting_request_of_higher_priority_preempts_a_running_one():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=1, max_batch_tokens=64)
    low = prioritised(make_seq(pool, prompt_of(8), max_new=10, name="low"), 5)
    sched.add(low)
    eng = FakeEngine(sched)
    eng.step()
    eng.step()
    high = prioritised(make_seq(pool, prompt_of(4, 100), max_new=2, name="high"), 0)
    same = prioritised(make_seq(pool, prompt_of(4, 200), max_new=2, name="same"), 5)
    sched.add(same)  # an equal priority never preempts
    sched.add(high)
    eng.step()
    assert sched.running == [high] and list(sched.waiting) == [low, same] and sched.preemptions == 1
    generated = low.ids[low.prompt_len :]
    eng.run()
    assert [s.ctx.name for s in eng.finished] == ["high", "low", "same"] and not sched.failed
    assert low.ids[: low.prompt_len + len(generated)] == prompt_of(8) + generated  # recomputed, unchanged


def test_out_of_blocks_preempts_the_lowest_priority_first():
    pool = FakePool(6)  # as in the test above: a and b need 5 blocks each by their end
    sched = Scheduler(pool, max_seqs=2, max_batch_tokens=64)
    a = prioritised(make_seq(pool, prompt_of(8), max_new=12, name="a"), 2)
    b = prioritised(make_seq(pool, prompt_of(8, 100), max_new=12, name="b"), 1)
    sched.add(a)
    sched.add(b)  # b is first in the queue (priority 1), a admitted after it
    eng = FakeEngine(sched)
    while not sched.preemptions:
        eng.step()
    assert sched.running == [b] and list(sched.waiting) == [a]  # a lost: lower priority, though admitted first
    eng.run()
    assert not sched.failed and len(eng.finished) == 2


def test_every_request_finishes_on_a_tiny_pool():
    pool = FakePool(10, block_size=4)  # 40 tokens for 12 requests that need up to 24 each
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=16)
    seqs = [
        make_seq(
            pool,
            prompt_of(3 + (5 * i) % 12, 1000 * i),
            max_new=4 + (3 * i) % 9,
            chunk=6 if i % 2 else None,
            name=f"r{i}",
        )
        for i in range(12)
    ]
    for s in seqs:
        sched.add(s)
    eng = FakeEngine(sched)
    eng.run(max_steps=2000)
    assert not sched.failed
    assert {id(s) for s in eng.finished} == {id(s) for s in seqs}
    assert all(s.known - s.prompt_len == s.max_new for s in seqs)
    assert sched.preemptions > 0  # the pool was tight enough to exercise preemption
    assert pool.free_blocks == 10  # every block came back


def test_a_request_that_can_never_fit_fails_alone_with_what_to_raise():
    pool = FakePool(3)  # 12 tokens
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=64)
    huge = make_seq(pool, prompt_of(20), name="huge")
    small = make_seq(pool, prompt_of(3, 100), max_new=2, name="small")
    sched.add(huge)
    sched.add(small)
    eng = FakeEngine(sched)
    eng.step()
    assert [s for s, _ in sched.failed] == [huge]
    err = sched.failed[0][1]
    assert isinstance(err, UserError) and "raise kv.memory" in str(err)
    assert huge not in sched.running and huge not in sched.waiting
    eng.run()
    assert eng.finished == [small] and small.known == 5


def test_a_request_that_fits_only_alone_fails_only_when_it_is_alone():
    pool = FakePool(4)  # 16 tokens; the big one needs 4 blocks at its end, alone
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=64)
    big = make_seq(pool, prompt_of(12), max_new=4, name="big")
    other = make_seq(pool, prompt_of(4, 100), max_new=4, name="other")
    sched.add(other)
    sched.add(big)
    eng = FakeEngine(sched)
    eng.run()
    assert not sched.failed and len(eng.finished) == 2


# --- removal ------------------------------------------------------------------------------------
def test_removing_a_waiting_request_means_it_is_never_admitted():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=1, max_batch_tokens=64)
    a, b, c = (make_seq(pool, prompt_of(4, 100 * i)) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    eng = FakeEngine(sched)
    eng.step()
    sched.remove(b)
    assert list(sched.waiting) == [c]
    eng.run()
    assert b not in eng.started and eng.fed(b) == []
    assert eng.finished == [a, c]


def test_removing_a_running_request_stops_it_and_frees_its_place():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=1, max_batch_tokens=64)
    a, b = make_seq(pool, prompt_of(4), max_new=10), make_seq(pool, prompt_of(4, 100))
    sched.add(a)
    sched.add(b)
    eng = FakeEngine(sched)
    eng.step()
    eng.step()
    sched.remove(a)
    a.cache.clear()  # (the engine returns its blocks)
    plan = eng.step()
    assert [i.seq for i in plan] == [b] and sched.running == [b]
    eng.run()
    assert len(eng.fed(a)) == 2 and eng.finished == [b]
    assert not sched.has_work()


# --- errors -------------------------------------------------------------------------------------
def test_nothing_to_schedule_with_running_sequences_is_an_error_not_a_hang():
    pool = FakePool(64)
    sched = Scheduler(pool, max_seqs=4, max_batch_tokens=64)
    seq = make_seq(pool, prompt_of(8), chunk=0)  # a prefill stage that plans empty chunks
    sched.add(seq)
    sched.admit(prepare, lambda s: None)
    with pytest.raises(RuntimeError, match="engine stalled"):
        sched.schedule(draft=lambda s, b: None)


def test_settings_are_checked():
    with pytest.raises(UserError, match="engine.max_seqs"):
        Scheduler(FakePool(4), max_seqs=0)
    with pytest.raises(UserError, match="engine.max_batch_tokens"):
        Scheduler(FakePool(4), max_batch_tokens=1.5)
