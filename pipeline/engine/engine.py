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

from pipeline.engine import bursts, ends
from pipeline.engine.handle import Cancelled, Handle
from pipeline.engine.intake import make_chunk, prepare
from pipeline.engine.postprocess import PostProcess, count_step
from pipeline.engine.scheduler import Scheduled, Scheduler
from pipeline.engine.sequence import Sequence, Status
from pipeline.errors import UserError, whole_number
from pipeline.memory import release_cached_memory, text_config
from pipeline.metrics import note_step
from pipeline.runner import ModelRunner, StepOutput, grammar
from pipeline.spec import propose
from pipeline.transfer import blocking_count


class Engine:
    """Scheduler + model runner + the step. ``max_seqs``: sequences in flight;
    ``max_batch_tokens``: tokens per forward (decode tokens first, prefill chunks fill the rest);
    ``burst``: greedy decode steps run back to back while no waiting request could take a place
    (1: every step reads its tokens)."""

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
        self.postprocess = PostProcess(self.scheduler, self.counters, runner)
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

    @property
    def waiting(self) -> int:
        """Sequences submitted and not yet admitted (new, or preempted to recompute)."""
        with self._cond:
            return len(self._inbox) + len(self.scheduler.waiting)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def stats(self) -> dict:
        """Engine figures: sequences, blocks (and recurrent-state slots), prefix-cache hit rate,
        the second tier's blocks, hits and loads (``kv_tier_*``), preemptions, tokens in/out,
        what a decode step runs (``ModelRunner.decode_kind``)."""
        pool, sched = self.pool, self.scheduler
        states = (
            {}
            if pool.states is None
            else {"state_slots_free": pool.states.free_slots, "state_slots_total": pool.states.num_slots - 1}
        )
        tier = {} if pool.tier is None else {f"kv_tier_{k}": v for k, v in pool.tier.stats().items()}
        return {
            "running": len(sched.running),
            "waiting": self.waiting,
            "kv_blocks_used": pool.used_blocks,
            "kv_blocks_free": pool.free_blocks,
            "kv_blocks_total": pool.num_blocks - 1,
            "prefix_cache_hit_rate": pool.hits / pool.lookups if pool.lookups else None,
            "kv_bytes_per_token": pool.block_bytes // pool.block_size,  # on each tensor-parallel rank
            "kv_dtype": pool.kv_dtype,
            "tp_ranks": pool.shards,
            "tp_collective_share": self.runner.collective_share,  # sampled steps, rank 0 (None: one process)
            **self.runner.decode_kind(),  # compiled or CUDA-graphed decode steps, once ready
            **states,
            **tier,
            **self.counters,
            **self._grammar_stats(),
            "busy_s": self.busy_s,
        }

    def adapters_in_flight(self) -> tuple[list[str], list[str]]:
        """The LoRA adapters of the running sequences and of the waiting ones, by name (a copy:
        any thread may ask while another steps)."""
        with self._cond:
            waiting = list(self._inbox)
        sched = self.scheduler
        waiting += list(sched.waiting)

        def names(seqs: list[Sequence]) -> list[str]:
            return sorted({s.adapter.name for s in seqs if s.adapter is not None})

        return names(list(sched.running)), names(waiting)

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
            plan = self.scheduler.schedule(propose)
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
        self.postprocess(plan, out)
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
            self.postprocess.choose_and_take([seq], logits.reshape(1, -1))

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
        quiet = not self._inbox and self.scheduler.none_admissible() and self.pool.states is None
        steps = bursts.length(plan, self.burst, quiet)
        if steps > 1:
            return bursts.run(self.runner, plan, steps)
        out = self.runner.forward([make_chunk(item) for item in plan])
        count_step(self.counters, sum(item.count for item in plan), self.pool.used_blocks)
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

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        ends.fail(self.scheduler, seq, err)
