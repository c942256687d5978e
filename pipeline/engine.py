"""Engine: many requests in flight over one paged KV pool (continuous batching).

    handle = pipe.submit(request)              # from any thread; Engine.submit(Sequence) below it
    for token_id in handle: ...                # tokens as they come
    result = handle.result()                   # or handle.cancel()

Design notes:

- One scheduler runs model steps, driven by whoever waits for a result (``Engine.drive``: one
  thread steps at a time, so all tensor work of a single caller stays on its thread). Each step
  feeds **one token for every decoding sequence plus prefill chunks of waiting ones**, packed
  into one forward (``pipeline.paged.forward``) under a token budget (``max_batch_tokens``),
  at most ``max_seqs`` sequences in flight; a finished sequence's place goes to the next
  waiting request at the next step. A single request is a batch of one through the same code:
  ``Pipeline.run``, the ``Prefill`` / ``DecodeLoop`` stages driven by hand and every mode use it.
- Admission runs a request's front stages (tokenize, vision and audio encoders) in a step,
  attaching prefix-cache blocks as soon as the prompt's cache keys are known, so the encoders
  skip media whose positions are already cached. A request whose next block another running
  sequence is computing waits for it (requests arriving together compute a shared prefix once).
- Out of blocks: a sequence that cannot grow preempts the most recently admitted sequence not
  yet scheduled in this step (it may be itself): its blocks are returned and it waits at the
  head of the queue; on readmission it recomputes prompt + tokens so far (mostly prefix-cache
  hits) and continues with the same sampler state, so its output does not change.
- Sampling is per sequence: each has its own sampler copy (settings and seeded generator), so
  a seeded request draws the same tokens alone or in any batch. Plain greedy rows are argmaxed
  together.
- Errors: a request's own bad input fails that request alone (its handle raises); a failed
  forward fails the sequences in that step and the engine goes on with the rest.
"""
from __future__ import annotations

import copy
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence as Seq

import torch

from pipeline.context import Context
from pipeline.errors import UserError
from pipeline.memory import text_config
from pipeline.metrics import synchronize
from pipeline.paged import BlockPool, Chunk, OutOfBlocks, forward


class Cancelled(Exception):
    """The request was cancelled from its handle before it finished."""


class TextStream:
    """Incremental detokenisation: emits only text that is complete (no half UTF-8 characters)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.text = text


def holdback(text: str, stops: Seq[str]) -> int:
    """Length of the longest tail of ``text`` that could still grow into a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def plain_greedy(sampler: Any) -> bool:
    """Argmax and nothing else: such rows are chosen together, on the device, even inside bursts."""
    from stages.sampler import Sampler

    return isinstance(sampler, Sampler) and sampler.greedy and sampler.repetition_penalty == 1.0


def fork_sampler(sampler: Any) -> Any:
    """A per-sequence copy: same settings, its own random generator (seeded afresh)."""
    if hasattr(sampler, "fork"):
        return sampler.fork()
    return copy.copy(sampler)


# --- one request in flight ------------------------------------------------------------------
@dataclass(eq=False)
class Sequence:
    """A request's state in the engine: its context, sampler, positions and the tokens so far.

    ``prefill_only``: stop after the prompt, leaving ``ctx.logits`` (C-Eval, the Prefill stage).
    ``front``: stages to run at admission (tokenize, encoders); ``after``: stages run once done.
    ``release``: return the cache's blocks when done (the caller keeps no handle on it).
    """

    ctx: Context
    sampler: Any
    front: Mapping[str, Callable] = field(default_factory=dict)
    after: Mapping[str, Callable] = field(default_factory=dict)
    prefill_only: bool = False
    release: bool = False
    chunk_size: int | None = None
    finalize: Callable[[Context], Any] | None = None
    handle: "Handle | None" = None
    spec: Any = None  # a drafter (pipeline.speculative): decode steps verify its drafts
    num_draft: int = 0  # drafts asked for per round
    # filled at admission
    prepared: bool = False
    prompt_len: int = 0
    ids: list[int] = field(default_factory=list)  # prompt + generated token ids
    keys: list = field(default_factory=list)  # their cache keys (media positions carry content hashes)
    positions: list[list[int]] = field(default_factory=list)  # [rows][prompt] position rows of the prompt
    offsets: list[int] = field(default_factory=list)  # [rows]: token p >= prompt has positions offsets + p
    blocks: list[tuple[int, int]] = field(default_factory=list)  # prompt spans attended both ways (never cut)
    stream: TextStream | None = None
    stops: list[str] = field(default_factory=list)
    eos: frozenset = frozenset()
    emitted: int = 0
    pending: torch.Tensor | None = None  # logits to sample from before the next forward
    drafts: list[int] = field(default_factory=list)  # drafted tokens in the step being run
    draft_q: torch.Tensor | None = None  # their draft distributions (None: point masses)
    cancelled: bool = False
    done: bool = False
    started: bool = False  # admitted at least once (queue_s recorded)

    @property
    def cache(self) -> Any:
        return self.ctx.cache

    @property
    def known(self) -> int:
        """Prompt + generated tokens; the cache holds all but the last generated one while decoding."""
        return len(self.ids)

    def prepare(self) -> None:
        """Front stages, prefix reuse, positions: everything before the first forward (in a step)."""
        ctx = self.ctx
        reused = None
        for name, stage in self.front.items():
            if ctx.token_keys is not None and reused is None:
                reused = ctx.cache.reuse(ctx.token_keys)
            skip = getattr(stage, "skip", None)
            if skip is not None and skip(ctx):
                continue
            with ctx.metrics.span(name):
                stage(ctx)
        if ctx.input_ids is None or ctx.input_ids.shape[1] == 0:
            raise UserError("the prompt has no tokens: there is nothing to prefill")
        req = ctx.request
        if not self.prefill_only and req.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1 (got {req.max_new_tokens})")
        total = self.prompt_len = int(ctx.input_ids.shape[1])
        context = getattr(text_config(ctx.lm.config), "max_position_embeddings", None)
        if not self.prefill_only and context and total + req.max_new_tokens > context:
            raise UserError(f"the prompt ({total} tokens) plus max_new_tokens ({req.max_new_tokens}) exceed the "
                            f"model's context of {context} tokens")
        ctx.cache.ensure_capacity(total + (0 if self.prefill_only else req.max_new_tokens - 1))
        # Recurrent layers: keep the state where the next chat turn comes back to (the prompt's
        # end, its reply header) and at the last block boundary a repeat of this prompt can
        # reuse (the prefix cache serves other requests there; one token is always computed).
        bs = ctx.cache.block_size
        ctx.cache.checkpoint_at(total, (total - 1) // bs * bs, *([ctx.reply_start] if ctx.reply_start else []))
        family, m = ctx.lm.family, ctx.metrics
        if self.pending is None:  # not prefilled yet: keep what the cache (and the prefix cache) holds
            start = reused if reused is not None else ctx.cache.reuse(ctx.token_keys)
            m.set("prompt_tokens", total)
            m.set("kv_reused_tokens", start)
            m.set("prefill_tokens", 0)
        elif ctx.cache.length != total or ctx.cache.keys != list(ctx.token_keys):
            raise ValueError("DecodeLoop needs the context Prefill just ran on (the cache must hold exactly the prompt)")
        pos = family.prompt_positions(ctx, 0)
        self.positions = pos.reshape(-1, pos.shape[-1]).tolist()
        self.offsets = family.decode_positions(ctx, 0).reshape(-1).tolist()
        self.blocks = [(int(a), int(b)) for a, b in family.bidirectional_spans(ctx)]
        self.ids = ctx.input_ids[0].tolist() + list(ctx.generated)
        self.keys = list(ctx.token_keys) + list(ctx.generated)
        if not self.prefill_only:
            self.stops = [s for s in req.stop if s]
            self.eos = frozenset() if req.ignore_eos else frozenset(ctx.lm.eos_token_ids)
            if ctx.on_text is not None or self.stops:
                self.stream = TextStream(ctx.lm.tokenizer)
        ctx.finish_reason = None
        self.prepared = True

    def next_chunk(self, budget: int) -> tuple[int, int]:
        """[begin, end) of the tokens to feed next within ``budget`` (end == begin: nothing).

        A chunk never ends inside a bidirectional block (``Family.bidirectional_spans``): the
        block's queries before the cut would miss its later keys. The cut moves back to the
        block's start, or, when the chunk begins at (or inside) the block, on to its end, so
        such a chunk may run past ``chunk_size`` / the budget by up to one block.
        """
        begin = self.cache.length
        todo = self.known - begin
        if todo > 1 or begin < self.prompt_len:  # prefill (or recompute after preemption)
            todo = min(todo, self.chunk_size or todo)
        end = begin + max(0, min(todo, budget))
        for start, stop in self.blocks:
            if start < end < stop and end > begin:
                end = start if start > begin else stop
                break
        return begin, end

    def chunk(self, begin: int, end: int, slots: list[int]) -> Chunk:
        """Tokens [begin, end), then this step's drafts (verified: the logits of each are kept)."""
        mid = min(end, self.prompt_len)
        positions = [row[begin:mid] for row in self.positions]
        drafts = self.drafts
        if end + len(drafts) > mid:  # generated tokens (decode, or recompute after a preemption)
            after = range(max(begin, self.prompt_len), end + len(drafts))
            positions = [row + [o + p for p in after] for row, o in zip(positions, self.offsets)]
        embeds = self.ctx.inputs_embeds
        extras = self.ctx.lm.family.chunk_extras(self.ctx, begin, mid) if mid > begin else None
        blocks = [(a, b) for a, b in self.blocks if a < mid and b > begin]
        if blocks:  # read by the paged attention (paged._query_limits)
            extras = {**(extras or {}), "blocks": blocks}
        return Chunk(
            table=list(self.cache.blocks), start=begin, ids=self.ids[begin:end] + drafts, positions=positions,
            slots=slots, embeds=embeds[0, begin:mid] if embeds is not None and mid > begin else None,
            state=self.cache.state_io,
            logits=(1 + len(drafts)) if end == self.known else 0, extras=extras,
        )

    def draft(self, budget: int) -> float:
        """Ask the drafter for this decode step's drafts (into ``drafts``); the seconds it took."""
        from pipeline.speculative import draft_budget

        k = draft_budget(self.num_draft, len(self.ctx.generated), self.ctx.request.max_new_tokens, budget)
        if k < 1:
            self.drafts, self.draft_q = [], None
            return 0.0
        t0 = time.perf_counter()
        self.drafts, self.draft_q = self.spec.propose(self.ids, k, self.sampler)
        self.ctx.metrics.count("spec_drafted", 0)  # counted when verified (a preempted step's drafts are not)
        return time.perf_counter() - t0

    def history(self) -> torch.Tensor:
        """[1, prompt + generated] ids, for samplers that look back (repetition penalty)."""
        return torch.tensor([self.ids], device=self.ctx.input_ids.device)

    # --- tokens ---------------------------------------------------------------------------
    def accept(self, token_id: int) -> bool:
        """Host side of one new token: record, stream, stop checks. True when the sequence ends."""
        ctx = self.ctx
        if not ctx.generated:
            ctx.metrics.first_token()
        ctx.generated.append(token_id)
        self.ids.append(token_id)
        self.keys.append(token_id)
        if self.handle is not None:
            self.handle._push(token_id)
        if self.stream is not None:
            self.stream.push(token_id)
            if self.stops and any(s in self.stream.text for s in self.stops):
                ctx.finish_reason = "stop"
                return True
            self.emit(self.stream.text, holdback(self.stream.text, self.stops))
        if token_id in self.eos:
            ctx.finish_reason = "eos"
            return True
        if len(ctx.generated) >= ctx.request.max_new_tokens:
            ctx.finish_reason = "length"
            return True
        return False

    def emit(self, text: str, hold: int) -> None:
        """Stream text[emitted : len(text) - hold]."""
        upto = len(text) - hold
        if self.ctx.on_text is not None and upto > self.emitted:
            self.ctx.on_text(text[self.emitted : upto])
        self.emitted = max(self.emitted, upto)

    def wrap_up(self) -> None:
        """Final text (cut before a stop string), the rest of the stream, counters."""
        ctx, m = self.ctx, self.ctx.metrics
        if self.prefill_only:
            return
        ctx.text = ctx.lm.tokenizer.decode(ctx.generated, skip_special_tokens=True)
        if ctx.finish_reason == "stop":
            ctx.text = ctx.text[: min(ctx.text.find(s) for s in self.stops if s in ctx.text)]
        self.emit(ctx.text, 0)
        m.set("decode_tokens", max(0, len(ctx.generated) - 1))
        m.set("generated_tokens", len(ctx.generated))


# --- handles --------------------------------------------------------------------------------
class Handle:
    """What ``submit`` returns: iterate for token ids as they come; ``result()`` waits for the end."""

    def __init__(self, engine: "Engine", seq: Sequence) -> None:
        self._engine = engine
        self._seq = seq
        self._done = threading.Event()
        self._tokens: queue.Queue = queue.Queue()
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Handle"], None]] = []
        self._lock = threading.Lock()

    def _push(self, token_id: int) -> None:
        self._tokens.put(token_id)

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        with self._lock:
            self._done.set()
            callbacks = list(self._callbacks)
        self._tokens.put(None)
        for fn in callbacks:
            fn(self)

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call ``fn(handle)`` when the request ends (at once if it has), on the thread that stepped."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    @property
    def context(self) -> Context:
        return self._seq.ctx

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop the request; its blocks are returned at the engine's next step."""
        self._seq.cancelled = True
        self._engine._wake()

    def result(self, timeout: float | None = None) -> Any:
        """The finished request (a Result, or the Context for context runs); raises its error.
        Waiting drives the engine (see ``Engine.drive``)."""
        self._engine.drive(self._done.is_set, timeout)
        if not self._done.is_set():
            raise TimeoutError("the request is still running")
        if self._error is not None:
            raise self._error
        return self._value

    def __iter__(self) -> Iterator[int]:
        while True:
            self._engine.drive(lambda: not self._tokens.empty())
            token = self._tokens.get()
            if token is None:
                if self._error is not None and not isinstance(self._error, Cancelled):
                    raise self._error
                return
            yield token


# --- the engine ------------------------------------------------------------------------------
class Engine:
    """The scheduler: waiting and running sequences, one packed forward per step.

    ``max_seqs``: sequences in flight. ``max_batch_tokens``: tokens per forward (decode tokens
    first, prefill chunks fill the rest). ``burst``: greedy decode steps run back to back when
    nobody waits (1: every step reads its tokens). ``compiled``: a ``CompiledStep`` for
    decode-only steps.
    """

    def __init__(
        self, lm: Any, pool: BlockPool, *, max_seqs: int = 8, max_batch_tokens: int = 2048, burst: int = 8,
        compiled: Any = None,
    ) -> None:
        from pipeline.errors import whole_number

        self.lm = lm
        self.device = lm.device  # (a property that walks the parameters: read once)
        self.pool = pool
        self.compiled = compiled  # a CompiledStep for decode-only steps (decode.compile), or None
        self.max_seqs = whole_number("engine.max_seqs", max_seqs)
        self.max_batch_tokens = whole_number("engine.max_batch_tokens", max_batch_tokens)
        self.burst = whole_number("engine.burst", burst)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._inbox: list[Sequence] = []
        self._cond = threading.Condition()
        self._driving = False  # a thread is inside step()
        self.counters = {"steps": 0, "tokens_in": 0, "tokens_out": 0, "preemptions": 0, "requests": 0,
                         "kv_blocks_peak": 0}
        self.busy_s = 0.0

    # --- submitting and driving ---------------------------------------------------------------
    def submit(self, seq: Sequence) -> Handle:
        """Queue a sequence (from any thread); returns its handle at once."""
        handle = Handle(self, seq)
        seq.handle = handle
        with self._cond:
            self._inbox.append(seq)
            self.counters["requests"] += 1
            self._cond.notify_all()
        return handle

    def drive(self, until: Callable[[], bool], timeout: float | None = None) -> None:
        """Run engine steps on the calling thread until ``until()`` holds (or ``timeout`` passes).

        Whoever waits for a result drives: one thread steps at a time, the others wait and take
        over between steps. So a single caller (the CLI, a batch, a benchmark) does all tensor
        work on its own thread, as a plain loop would; several threads share the steps. (A
        dedicated engine thread would hand every step to another OS thread, whose CPU thread
        pool then competes with the caller's for the same cores: measured 3-4x slower decode.)
        """
        with torch.inference_mode():
            self._drive(until, None if timeout is None else time.perf_counter() + timeout)

    def _drive(self, until: Callable[[], bool], deadline: float | None) -> None:
        while not until():
            if deadline is not None and time.perf_counter() >= deadline:
                return
            with self._cond:
                if self._driving or not (self._inbox or self.waiting or self.running):
                    self._cond.wait(0.05)  # another thread is stepping, or our work was done by one
                    continue
                self._driving = True
            try:
                self.step()
            finally:
                with self._cond:
                    self._driving = False
                    self._cond.notify_all()

    def run(self, seqs: Seq[Sequence]) -> None:
        """Run sequences to the end on the calling thread (the stages driven by hand)."""
        handles = [self.submit(seq) for seq in seqs]
        self.drive(lambda: all(h.done() for h in handles))
        for handle in handles:
            handle.result()  # raise the first error

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def stats(self) -> dict:
        """Engine figures: sequences, blocks (and recurrent-state slots), prefix-cache hit rate,
        preemptions, tokens in/out."""
        pool = self.pool
        states = {} if pool.states is None else {
            "state_slots_free": pool.states.free_slots, "state_slots_total": pool.states.num_slots - 1}
        return {
            "running": len(self.running),
            "waiting": len(self.waiting) + len(self._inbox),
            "kv_blocks_used": pool.used_blocks,
            "kv_blocks_free": pool.free_blocks,
            "kv_blocks_total": pool.num_blocks - 1,
            "prefix_cache_hit_rate": pool.hits / pool.lookups if pool.lookups else None,
            **states,
            **self.counters,
            "busy_s": self.busy_s,
        }

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> None:
        t0 = time.perf_counter()
        with self._cond:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        plan: list[tuple[Sequence, Chunk]] = []
        try:
            self._drop_cancelled()
            self._admit()
            self._sample_pending()
            plan = self._schedule()
            if plan:
                self._run(plan)
        except BaseException as err:  # a failed step (Ctrl-C in a hook too): fail its sequences, serve the rest
            for seq in [s for s, _ in plan] or list(self.running):
                self._fail(seq, err)
        self.busy_s += time.perf_counter() - t0

    def _drop_cancelled(self) -> None:
        for seq in [s for s in (*self.waiting, *self.running) if s.cancelled]:
            self._fail(seq, Cancelled("cancelled"))

    def _admit(self) -> None:
        """Move waiting sequences into the running set while there is room (sequences and blocks).

        A sequence whose next block another running sequence is computing right now waits until
        that prefill is done, then takes it from the prefix cache: requests that share a system
        prompt or an image, arriving together, compute it once.
        """
        # (Recurrent layers: a block is of use only with a state at its end, so nobody waits.)
        computing = {d for s in self.running if s.cache.length < s.prompt_len and self.pool.states is None
                     for d in s.cache.future_digests(s.keys[: s.prompt_len])}
        for seq in list(self.waiting):
            if len(self.running) >= self.max_seqs:
                return
            if not seq.prepared:
                try:
                    seq.prepare()
                except BaseException as err:
                    self._fail(seq, err)
                    continue
            else:  # readmitted (preempted, or deferred): take what the prefix cache has now
                before = seq.cache.length
                seq.cache.reuse(seq.keys[: seq.known])
                if not seq.started and seq.cache.length != before:
                    seq.ctx.metrics.set("kv_reused_tokens", seq.cache.length)
            upcoming = seq.cache.future_digests(seq.keys[: seq.prompt_len], limit=1)
            if upcoming and upcoming[0] in computing and seq.cache.length % self.pool.block_size == 0:
                continue  # deferred: another sequence is computing its next block
            # Its prompt's blocks, plus headroom for the running ones to grow (else it is admitted
            # only to be preempted at the next block boundary).
            need = -(-(seq.known - seq.cache.length) // self.pool.block_size) + 1 + len(self.running) // 8
            states = self.pool.states
            if self.running and (self.pool.free_blocks < need or (states is not None and states.free_slots < 2)):
                return  # new requests wait for blocks (and state slots) to come back
            if not seq.started:
                seq.started = True
                m = seq.ctx.metrics
                if m.t_start is None:  # driven by hand without metrics.start()
                    m.start()
                m.set("queue_s", time.perf_counter() - m.t_start)
            self.waiting.remove(seq)
            self.running.append(seq)
            if seq.cache.length < seq.prompt_len:
                computing.update(seq.cache.future_digests(seq.keys[: seq.prompt_len]))

    def _sample_pending(self) -> None:
        """Sequences handed over with prefill logits (DecodeLoop by hand) choose their first token."""
        for seq in [s for s in self.running if s.pending is not None]:
            logits, seq.pending = seq.pending, None
            self._choose([seq], logits.reshape(1, -1))

    def _schedule(self) -> list[tuple[Sequence, Chunk]]:
        """Chunks for this step: decode tokens first, then prefill chunks, under the token budget."""
        budget = self.max_batch_tokens
        order = sorted(self.running, key=lambda s: s.cache.length < s.prompt_len or s.known - s.cache.length > 1)
        plan: list[tuple[Sequence, Chunk]] = []
        scheduled: set[int] = set()
        for seq in order:
            if seq not in self.running or seq.done:
                continue  # preempted earlier in this loop
            begin, end = seq.next_chunk(budget)
            if end <= begin:
                continue
            seq.drafts = []
            if seq.spec is not None and end - begin == 1 and begin >= seq.prompt_len and not seq.prefill_only:
                seq.ctx.metrics.add_span("draft", seq.draft(budget), 1)
            while True:
                try:
                    slots = seq.cache.reserve(end - begin + len(seq.drafts), every_position=bool(seq.drafts))
                    break
                except OutOfBlocks:
                    victim = next((s for s in reversed(self.running) if id(s) not in scheduled), seq)
                    self._preempt(victim)
                    if victim is seq:
                        break
            if seq not in self.running:
                continue
            plan.append((seq, seq.chunk(begin, end, slots)))
            scheduled.add(id(seq))
            budget -= end - begin + len(seq.drafts)
            if budget <= 0:
                break
        if not plan and self.running and not self.waiting:
            raise RuntimeError("engine stalled: running sequences but nothing to schedule")
        return plan

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it recomputes later from the head of the queue."""
        self.running.remove(seq)
        seq.cache.clear()
        self.waiting.appendleft(seq)
        self.counters["preemptions"] += 1
        seq.ctx.metrics.count("preemptions")
        states = self.pool.states
        if not self.running and (self.pool.free_blocks < -(-seq.known // self.pool.block_size)
                                 or (states is not None and states.free_slots == 0)):
            self._fail(seq, UserError("the KV pool is full of blocks held by other caches: raise kv.memory"))

    def _run(self, plan: list[tuple[Sequence, Chunk]]) -> None:
        steps = self._burst_length(plan)
        if steps > 1:
            self._burst(plan, steps)
            return
        device = self.device
        t0 = time.perf_counter()
        chunks = [c for _, c in plan]
        compiled = self.compiled is not None and all(c.count == 1 for c in chunks)
        logits = (self.compiled if compiled else forward)(self.lm, self.pool, chunks, device=device)
        compiled = compiled and self.compiled.why_not(self.lm) is None
        synchronize(device)
        seconds = time.perf_counter() - t0
        self.counters["steps"] += 1
        self.counters["tokens_in"] += sum(c.count for _, c in plan)
        self.counters["kv_blocks_peak"] = max(self.counters["kv_blocks_peak"], self.pool.used_blocks)
        ready, verifying, row = [], [], 0
        for seq, chunk in plan:  # logits rows come in the order of the chunks, chunk.logits each
            if seq.drafts:
                verifying.append((seq, logits[row : row + chunk.logits]))
            elif chunk.start < seq.prompt_len or chunk.count > 1:
                seq.cache.append(seq.keys[chunk.start : chunk.start + chunk.count])
                seq.ctx.metrics.add_span("prefill", seconds, 1)
                seq.ctx.metrics.count("prefill_tokens", chunk.count)
            else:
                self._decoded(seq, seconds, compiled)
            if chunk.logits and not seq.drafts:
                ready.append((seq, row))
            row += chunk.logits
        sampling, rows = [], []
        for seq, i in ready:
            if seq.prefill_only:
                seq.ctx.logits = logits[i : i + 1]
                self._finish(seq)
            else:
                sampling.append(seq)
                rows.append(i)
        if sampling:
            self._choose(sampling, logits if len(rows) == logits.shape[0] else logits[rows])
        for seq, rows_of_seq in verifying:
            self._verify(seq, rows_of_seq, seconds)

    # --- decode bursts ------------------------------------------------------------------------
    def _burst_length(self, plan: list[tuple[Sequence, Chunk]]) -> int:
        """How many decode steps this step may run back to back (1: an ordinary step).

        A burst needs a decode-only step of plain greedy sequences and nobody waiting to be
        admitted; it is as long as the sequence with the fewest tokens left allows.
        """
        if self.burst < 2 or self.waiting or self._inbox or self.pool.states is not None:
            return 1  # (recurrent states are read and written per step, not inside a burst)
        steps = self.burst
        for seq, chunk in plan:
            decoding = chunk.count == 1 and chunk.start >= seq.prompt_len and seq.known - chunk.start == 1
            if not decoding or seq.prefill_only or seq.spec is not None or not plain_greedy(seq.sampler):
                return 1
            steps = min(steps, seq.ctx.request.max_new_tokens - len(seq.ctx.generated))
        return steps

    def _burst(self, plan: list[tuple[Sequence, Chunk]], steps: int) -> None:
        """Several greedy decode steps with no host work between them (``paged.greedy_step``, the
        chosen token fed straight back), then the host side of every token in order.

        gpt-fast's lesson again: at small batch a step's Python costs as much as its arithmetic.
        A row that ends inside the burst (EOS, a stop string) had its later tokens computed for
        nothing; they are dropped, and so are their slots (``_finish`` trims the cache).
        """
        from pipeline.paged import burst_state, run_burst

        try:
            for seq, chunk in plan:
                seq.cache.reserve(steps)  # the step's one slot already reserved, the rest now
        except OutOfBlocks:
            steps = 1  # no room to run ahead: one step, the slots reserved so far used as they come
        chunks = [c for _, c in plan]
        positions = [[c.positions[r][0] for c in chunks] for r in range(len(chunks[0].positions))]
        pool = self.pool
        state = burst_state(pool, [c.ids[0] for c in chunks], positions, [c.start for c in chunks],
                            [seq.cache.blocks for seq, _ in plan], steps, self.device)
        t0 = time.perf_counter()
        chosen = run_burst(self.lm, pool, state, steps, self.compiled)
        tokens = torch.cat(chosen).tolist()  # [steps][rows]: the one host read of the burst
        compiled = self.compiled is not None and self.compiled.why_not(self.lm) is None
        seconds = (time.perf_counter() - t0) / steps
        self.counters["kv_blocks_peak"] = max(self.counters["kv_blocks_peak"], pool.used_blocks)
        alive = [(row, seq) for row, (seq, _) in enumerate(plan)]
        for row_tokens in tokens:
            self.counters["steps"] += 1
            self.counters["tokens_in"] += len(alive)
            for _, seq in alive:
                self._decoded(seq, seconds, compiled)
            self._accept([seq for _, seq in alive], [row_tokens[row] for row, _ in alive], 0.0)
            alive = [(row, seq) for row, seq in alive if not seq.done]
            if not alive:
                break

    def _verify(self, seq: Sequence, logits: torch.Tensor, seconds: float) -> None:
        """Keep the accepted drafts and one token of the target's own; roll the cache back past
        the rejected drafts (the forward wrote all of them)."""
        from pipeline.speculative import verify

        drafts, m = seq.drafts, seq.ctx.metrics
        t0 = time.perf_counter()
        tokens, accepted = verify(seq.sampler, logits, drafts, seq.draft_q, seq.ids)
        sample_s = time.perf_counter() - t0
        seq.cache.append([seq.keys[seq.cache.length]] + drafts)
        seq.cache.rollback(seq.cache.length - (len(drafts) - accepted))
        seq.drafts, seq.draft_q = [], None
        m.add_span("decode", seconds, 1)
        m.count("spec_drafted", len(drafts))
        m.count("spec_accepted", accepted)
        for token in tokens:
            self._accept([seq], [token], sample_s)
            sample_s = 0.0
            if seq.done:
                break

    @staticmethod
    def _decoded(seq: Sequence, seconds: float, compiled: bool) -> None:
        """Record one fed decode token (its key into the cache) and the step's time."""
        seq.cache.append([seq.keys[seq.cache.length]])
        m = seq.ctx.metrics
        m.add_span("decode", seconds, 1)
        m.info["decode_compiled"] = compiled or bool(m.info.get("decode_compiled"))

    def _choose(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token per sequence (plain greedy rows together), then the host-side checks."""
        t0 = time.perf_counter()
        values: list[int | None] = [None] * len(seqs)
        plain = [i for i, s in enumerate(seqs) if plain_greedy(s.sampler)]
        if plain:
            chosen = (logits if len(plain) == len(seqs) else logits[plain]).argmax(dim=-1).tolist()
            for i, token in zip(plain, chosen):
                values[i] = token
        for i, seq in enumerate(seqs):
            if values[i] is None:
                values[i] = int(seq.sampler(logits[i : i + 1], seq.history()).reshape(-1)[0])
        self._accept(seqs, values, time.perf_counter() - t0)

    def _accept(self, seqs: list[Sequence], values: list[int], sample_s: float) -> None:
        """The host side of one chosen token per sequence: record, stream, stop checks, finish."""
        self.counters["tokens_out"] += len(values)
        for seq, token_id in zip(seqs, values):
            seq.ctx.metrics.add_span("sample", sample_s, 1)
            try:
                done = seq.accept(int(token_id))
            except BaseException as err:  # its streaming callback raised (Ctrl-C in a chat): that request ends
                self._fail(seq, err)
                continue
            if done:
                self._finish(seq)

    # --- ends ---------------------------------------------------------------------------------
    def _remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.done = True

    def _finish(self, seq: Sequence) -> None:
        self._remove(seq)
        ctx = seq.ctx
        if seq.spec is not None:
            seq.spec.close()
            if not seq.prefill_only and ctx.cache.length > seq.known - 1:
                ctx.cache.rollback(seq.known - 1)  # accepted drafts past an EOS or a stop string
        try:
            seq.wrap_up()
            ctx.cache.trim()
            ctx.metrics.set("kv_cache_bytes", ctx.cache.nbytes)
            for name, stage in seq.after.items():
                with ctx.metrics.span(name):
                    stage(ctx)
            ctx.metrics.end()
            value = seq.finalize(ctx) if seq.finalize is not None else ctx
        except BaseException as err:
            self._fail(seq, err)
            return
        if seq.release:
            ctx.cache.clear()
        handle, seq.handle = seq.handle, None  # no cycle once done: dropping the handle frees the cache
        handle._finish(value)

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        self._remove(seq)
        if seq.spec is not None:
            seq.spec.close()
        try:
            if seq.release:
                seq.ctx.cache.clear()
            else:
                seq.ctx.cache.trim()
        except Exception:
            seq.ctx.cache.clear()
        handle, seq.handle = seq.handle, None
        if handle is not None:
            handle._finish(error=err)
