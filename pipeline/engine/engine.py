"""The engine loop: many requests in flight over one paged KV pool (continuous batching).

    handle = engine.submit(seq)        # from any thread (Pipeline.submit builds the sequence)
    for token_id in handle: ...        # tokens as they come
    result = handle.result()           # or handle.cancel()

A step is intake (new and cancelled requests), schedule (``Scheduler``: which sequences feed
which tokens), run (``ModelRunner``: one packed forward, or a greedy decode burst), post-process
(each sequence's logits processors, its sampler or the draft verification, stop checks) and
finish. A single request is a batch of one through the same code.

**Who drives.** There is no engine thread: whoever waits for a result drives the steps
(``drive``; ``Handle.result`` and iteration call it). One thread steps at a time; the others
wait and take over between steps. So a single caller (the CLI, a batch, a benchmark) does all
tensor work on its own thread, as a plain loop would, and several threads share the steps.
The server is one such caller: its driver thread (``pipeline.serve.app``) drives while any
request is in flight. (A dedicated engine thread would hand every step to another OS thread,
whose CPU thread pool then competes with the caller's for the same cores: measured 3-4x
slower decode.)

Errors: a request's own bad input fails that request alone (its handle raises); a failed
forward fails the sequences in that step and the engine goes on with the rest.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait as wait_any
from typing import Any, Callable, Sequence as Seq

import torch

from pipeline.context import TokenLogprob
from pipeline.engine import bursts, ends, token_choice
from pipeline.engine.handle import Cancelled, Handle
from pipeline.engine.intake import chosen_rows, kept_rows, make_chunk, prepare, prompt_rows
from pipeline.engine.scheduler import Scheduled, Scheduler
from pipeline.engine.sequence import Sequence, Status
from pipeline.errors import UserError, whole_number
from pipeline.memory import release_cached_memory, text_config
from pipeline.metrics import note_step
from pipeline.runner import ModelRunner, StepOutput, grammar
from pipeline.spec import draft_budget, verify
from pipeline.transfer import blocking_count, read, wait


class Engine:
    """Scheduler + model runner + the step. ``max_seqs``: sequences in flight;
    ``max_batch_tokens``: tokens per forward (decode tokens first, prefill chunks fill the rest);
    ``burst``: greedy decode steps run back to back when nobody waits (1: every step reads its
    tokens)."""

    def __init__(self, runner: ModelRunner, *, max_seqs: int = 8, max_batch_tokens: int = 2048, burst: int = 8) -> None:
        self.runner = runner
        self.scheduler = Scheduler(runner.pool, max_seqs, max_batch_tokens)
        self.burst = whole_number("engine.burst", burst)
        self._inbox: list[Sequence] = []
        self._cond = threading.Condition()
        self._driving = False  # a thread is inside step()
        self.counters = {
            "steps": 0,
            "tokens_in": 0,
            "tokens_out": 0,
            "preemptions": 0,
            "requests": 0,
            "kv_blocks_peak": 0,
            "blocking_transfers": 0,
            "blocking_transfers_step_max": 0,
            "oom_retries": 0,
        }
        self.busy_s = 0.0
        self._grammars: grammar.Grammars | None = None  # made on the first constrained request

    @property
    def pool(self) -> Any:
        return self.runner.pool

    @property
    def device(self) -> torch.device:
        return self.runner.device

    # --- submitting and driving ---------------------------------------------------------------
    def submit(self, seq: Sequence) -> Handle:
        """Queue a sequence (from any thread); returns its handle at once. A bad output
        constraint raises ``UserError`` here; a good one starts compiling."""
        seq.grammar = self._constrain(seq)
        handle = Handle(self, seq)
        seq.handle = handle
        with self._cond:
            self._inbox.append(seq)
            self.counters["requests"] += 1
            self._cond.notify_all()
        return handle

    def _constrain(self, seq: Sequence) -> grammar.Matcher | None:
        """The sequence's matcher when its request has an output constraint (``Request.json_schema``...)."""
        request = seq.ctx.request
        if not grammar.requested(request):
            return None
        if seq.prefill_only:
            raise UserError("an output constraint needs a decode stage (stages.decode is null)")
        with self._cond:
            if self._grammars is None:
                lm = seq.ctx.lm
                self._grammars = grammar.Grammars(
                    lm.tokenizer, int(text_config(lm.config).vocab_size), lm.eos_token_ids
                )
        grammars = self._grammars
        think = grammars.think_ids is not None and request.thinking is True  # reasoning first, then the constraint
        return grammars.open(grammar.constraint_of(request, think))

    def drive(self, until: Callable[[], bool], timeout: float | None = None) -> None:
        """Run engine steps on the calling thread until ``until()`` holds (or ``timeout`` passes);
        while another thread is stepping, wait for it (see the module docstring)."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        with torch.inference_mode():
            while not until():
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                if self._take_turn():
                    try:
                        self.step()
                    finally:
                        with self._cond:
                            self._driving = False
                            self._cond.notify_all()

    def _take_turn(self) -> bool:
        with self._cond:
            if self._driving or not (self._inbox or self.scheduler.has_work()):
                self._cond.wait(0.05)  # another thread is stepping, or our work was done by one
                return False
            self._driving = True
            return True

    def run(self, seqs: Seq[Sequence]) -> None:
        """Run sequences to the end on the calling thread."""
        handles = [self.submit(seq) for seq in seqs]
        self.drive(lambda: all(h.done() for h in handles))
        for handle in handles:
            handle.result()  # raise the first error

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def stats(self) -> dict:
        """Engine figures: sequences, blocks (and recurrent-state slots), prefix-cache hit rate,
        the second tier's blocks, hits and loads (``kv_tier_*``), preemptions, tokens in/out."""
        pool, sched = self.pool, self.scheduler
        states = (
            {}
            if pool.states is None
            else {"state_slots_free": pool.states.free_slots, "state_slots_total": pool.states.num_slots - 1}
        )
        tier = {} if pool.tier is None else {f"kv_tier_{k}": v for k, v in pool.tier.stats().items()}
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting) + len(self._inbox),
            "kv_blocks_used": pool.used_blocks,
            "kv_blocks_free": pool.free_blocks,
            "kv_blocks_total": pool.num_blocks - 1,
            "prefix_cache_hit_rate": pool.hits / pool.lookups if pool.lookups else None,
            "kv_bytes_per_token": pool.block_bytes // pool.block_size,  # on each tensor-parallel rank
            "kv_dtype": pool.kv_dtype,
            "tp_ranks": pool.shards,
            "tp_collective_share": self.runner.collective_share,  # sampled steps, rank 0 (None: one process)
            **states,
            **tier,
            **self.counters,
            **self._grammar_stats(),
            "busy_s": self.busy_s,
        }

    def _grammar_stats(self) -> dict:
        g = self._grammars
        if g is None:
            return {}
        return {
            "grammar_compiles": g.compiles,
            "grammar_compile_s": g.compile_s,
            "grammar_masks": g.masks,
            "grammar_step_s": g.step_s,
        }

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> None:
        """Intake, schedule, run, post-process, finish."""
        t0, waits = time.perf_counter(), blocking_count()
        plan: list[Scheduled] = []
        try:
            self._intake()
            plan = self.scheduler.schedule(self._draft)
            if plan:
                plan = self._run_plan(plan)
            else:
                self._await_grammars()
        except BaseException as err:  # a failed step (Ctrl-C in a hook too): fail its sequences, serve the rest
            for seq in [item.seq for item in plan] or list(self.scheduler.running):
                self._fail(seq, err)
        self._fail_refused()
        self._count_busy(plan, blocking_count() - waits, time.perf_counter() - t0)

    def _run_plan(self, plan: list[Scheduled]) -> list[Scheduled]:
        """Run the step and take what it produced into each sequence; [] when the device ran out of
        memory (its sequences wait for a smaller step)."""
        out = self._run_or_shrink(plan)
        if out is None:
            return []
        metrics = [item.seq.ctx.metrics for item in plan]
        note_step(metrics, [item.end for item in plan], self.pool, len(out.tokens) if out.tokens else 1)
        self._postprocess(plan, out)
        return plan

    def _count_busy(self, plan: list[Scheduled], waits: int, seconds: float) -> None:
        """The step's counters: preemptions so far, the host's waits for the device, busy time."""
        self.counters["preemptions"] = self.scheduler.preemptions
        if plan:
            self.counters["blocking_transfers"] += waits
            self.counters["blocking_transfers_step_max"] = max(self.counters["blocking_transfers_step_max"], waits)
        self.busy_s += seconds

    def _intake(self) -> None:
        """New requests join the queue, cancelled ones end, waiting ones are admitted, and
        sequences handed over with prefill logits (DecodeLoop by hand) choose their first token."""
        with self._cond:
            for seq in self._inbox:
                self.scheduler.add(seq)
            self._inbox.clear()
        sched = self.scheduler
        for seq in [s for s in (*sched.waiting, *sched.running) if s.cancelled]:
            self._fail(seq, Cancelled("cancelled"))
        sched.admit(prepare, self._started)
        self._fail_refused()
        for seq in [s for s in sched.running if s.pending is not None]:
            logits, seq.pending = seq.pending, None
            self._choose_and_take([seq], logits.reshape(1, -1))

    @staticmethod
    def _started(seq: Sequence) -> None:
        m = seq.ctx.metrics
        if m.t_start is None:  # driven by hand without metrics.start()
            m.start()
        m.set("queue_s", time.perf_counter() - m.t_start)

    def _await_grammars(self) -> None:
        """Nothing to run while requests wait for their grammars to compile: wait for one (briefly)."""
        compiling = [
            s.grammar.compiled for s in self.scheduler.waiting if s.grammar is not None and not s.grammar.ready
        ]
        if compiling and not self.scheduler.running:
            wait_any(compiling, timeout=0.05, return_when=FIRST_COMPLETED)

    def _fail_refused(self) -> None:
        while self.scheduler.failed:
            self._fail(*self.scheduler.failed.pop(0))

    def _run(self, plan: list[Scheduled]) -> StepOutput:
        """The model step: one packed forward, or a greedy decode burst."""
        quiet = not (self.scheduler.waiting or self._inbox) and self.pool.states is None
        steps = bursts.length(plan, self.burst, quiet)
        if steps > 1:
            return bursts.run(self.runner, plan, steps)
        out = self.runner.forward([make_chunk(item) for item in plan])
        self._count_step(sum(item.count for item in plan))
        return out

    def _run_or_shrink(self, plan: list[Scheduled]) -> StepOutput | None:
        """``_run``; when the device runs out of memory, the step's sequences go back to the queue
        (preempted: what they had in the prefix cache they reuse, the rest they recompute) and
        later steps take half the tokens, down to one block's worth; None then. Only a step that
        cannot shrink (one block's worth of tokens, or one decode row) fails."""
        try:
            return self._run(plan)
        except torch.OutOfMemoryError:
            budget = self.scheduler.max_batch_tokens
            smallest = self.pool.block_size
            if budget <= smallest or sum(item.count for item in plan) <= 1:
                raise
            release_cached_memory(self.runner.device)
            for item in plan:
                if item.seq.status is Status.RUNNING:
                    self.scheduler.preempt(item.seq)
                item.seq.ctx.metrics.count("oom_retries")
            self.scheduler.max_batch_tokens = max(smallest, budget // 2)
            self.counters["oom_retries"] += 1
            return None

    def _count_step(self, tokens_in: int) -> None:
        self.counters["steps"] += 1
        self.counters["tokens_in"] += tokens_in
        self.counters["kv_blocks_peak"] = max(self.counters["kv_blocks_peak"], self.pool.used_blocks)

    def _postprocess(self, plan: list[Scheduled], out: StepOutput) -> None:
        """What the step produced, into each sequence: a burst's tokens in order, or the
        forward's logits rows, which come in plan order, each part's ``1 + drafts`` when it ends
        at the known tokens (none for a prefill chunk before the prompt's end).

        The chosen tokens are read back first: that read is the step's one wait for the device
        (a step that chooses none waits once instead), and it ends the step's timing."""
        if out.tokens is not None:
            self._take_burst(plan, out)
            return
        logits, row = out.logits, 0
        choosing, rows, verifying, recorded, ending, scoring = [], [], [], [], [], []
        for item in plan:
            seq, n = item.seq, chosen_rows(item)
            if prompt_rows(item):
                scoring.append((item, row))
            first = row + kept_rows(item) - n  # the choosing rows are the part's last
            if seq.drafts:
                verifying.append((seq, logits[first : first + n]))
            else:
                recorded.append(item)
            if n and not seq.drafts:
                if seq.prefill_only:
                    seq.ctx.logits = logits[first : first + 1]
                    ending.append(seq)
                else:
                    choosing.append(seq)
                    rows.append(first)
            row += kept_rows(item)
        scores = token_choice.prompt_scores(scoring, logits)
        picked = None
        if choosing:
            picked = token_choice.pick(choosing, logits if len(rows) == logits.shape[0] else logits[rows], scores)
            scores = picked[3]
        elif scores is not None:
            scores = read(scores)
        else:
            wait(self.runner.device)
        out.finish_timing()
        if scoring:
            token_choice.take_prompt_scores(scoring, scores)
        for item in recorded:
            self._record_fed(item, out)
        for seq in ending:
            ends.finish(self.scheduler, seq)
        if picked is not None:
            self._take_chosen(choosing, *picked[:3])
        for seq, seq_logits in verifying:
            self._verify(seq, seq_logits, out.seconds)

    def _record_fed(self, item: Scheduled, out: StepOutput) -> None:
        """The fed tokens' keys into the cache, and the step's time as prefill or decode."""
        seq = item.seq
        seq.cache.append(seq.keys[item.begin : item.end])
        m = seq.ctx.metrics
        if item.begin < seq.prompt_len or item.end - item.begin > 1:
            m.add_span("prefill", out.seconds, 1)
            m.count("prefill_tokens", item.end - item.begin)
        else:
            m.add_span("decode", out.seconds, 1)
            m.info["decode_compiled"] = out.compiled or bool(m.info.get("decode_compiled"))
            m.info["decode_cuda_graphs"] = out.graphed or bool(m.info.get("decode_cuda_graphs"))

    # --- choosing tokens ----------------------------------------------------------------------
    def _choose_and_take(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Choose and take one token per sequence."""
        self._take_chosen(seqs, *token_choice.pick(seqs, logits)[:3])

    def _take_chosen(
        self, seqs: list[Sequence], tokens: list[int], sample_s: float, scored: Seq[TokenLogprob | None] = ()
    ) -> None:
        """The host side of one chosen token per sequence: record, stream, hooks, finish."""
        self.counters["tokens_out"] += len(tokens)
        for i, (seq, token_id) in enumerate(zip(seqs, tokens)):
            seq.ctx.metrics.add_span("sample", sample_s, 1)
            if i < len(scored) and scored[i] is not None:
                seq.ctx.logprobs.append(scored[i])
            try:
                reason = token_choice.take(seq, int(token_id))
            except BaseException as err:  # its streaming callback or hook raised (Ctrl-C in a chat): it ends
                self._fail(seq, err)
                continue
            if reason is not None:
                seq.ctx.finish_reason = reason
                ends.finish(self.scheduler, seq)

    # --- decode bursts ------------------------------------------------------------------------
    def _take_burst(self, plan: list[Scheduled], out: StepOutput) -> None:
        """A burst's tokens, step by step. A row that ends inside the burst (EOS, a stop string)
        had its later tokens computed for nothing; they are dropped, and so are their slots
        (``ends.finish`` trims)."""
        alive = list(enumerate(plan))
        for row_tokens in out.tokens:
            self._count_step(len(alive))
            for _, item in alive:
                self._record_fed(Scheduled(item.seq, item.seq.cache.length, item.seq.cache.length + 1, []), out)
            self._take_chosen([item.seq for _, item in alive], [row_tokens[row] for row, _ in alive], 0.0)
            alive = [(row, item) for row, item in alive if not item.seq.done]
            if not alive:
                break

    # --- speculative decoding -----------------------------------------------------------------
    @staticmethod
    def _draft(seq: Sequence, budget: int) -> None:
        """Ask the sequence's drafter for this decode step's drafts."""
        spec, ctx = seq.spec, seq.ctx
        k = draft_budget(spec.per_round, len(ctx.generated), ctx.request.max_new_tokens, budget)
        t0 = time.perf_counter()
        if k >= 1:
            spec.drafts, spec.q = spec.drafter.propose(seq.ids, k, seq.sampler)
        ctx.metrics.add_span("draft", time.perf_counter() - t0 if k >= 1 else 0.0, 1)
        ctx.metrics.count("spec_drafted", 0)  # counted when verified (a preempted step's drafts are not)

    def _verify(self, seq: Sequence, logits: torch.Tensor, seconds: float) -> None:
        """Keep the accepted drafts and one token of the target's own; roll the cache back past
        the rejected drafts (the forward wrote all of them)."""
        spec, m = seq.spec, seq.ctx.metrics
        drafts, checked, q = spec.drafts, spec.drafts, spec.q
        t0 = time.perf_counter()
        if seq.grammar is not None:  # drafts the grammar refuses are never kept: check only the rest
            n = seq.grammar.allowed_drafts(drafts)
            checked, q = drafts[:n], None if q is None else q[:n]
            logits = grammar.mask_rows(logits[: n + 1], [(i, seq.grammar, drafts[:i]) for i in range(n + 1)])
        tokens, accepted = verify(seq.sampler, logits, checked, q, seq.ids, seq.ctx.generated)
        sample_s = time.perf_counter() - t0
        seq.cache.append([seq.keys[seq.cache.length]] + drafts)
        seq.cache.rollback(seq.cache.length - (len(drafts) - accepted))
        spec.drafts, spec.q = [], None
        m.add_span("decode", seconds, 1)
        m.count("spec_drafted", len(drafts))
        m.count("spec_accepted", accepted)
        for token in tokens:
            self._take_chosen([seq], [token], sample_s)
            sample_s = 0.0
            if seq.done:
                break

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        ends.fail(self.scheduler, seq, err)
