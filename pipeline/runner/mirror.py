"""One engine over many ranks (tensor parallel): rank 0's model runners send each step to the other
ranks, which run the same step on their shards of the weights and their share of the KV heads.

Only rank 0 schedules, so only its pool hands out blocks; a step's message carries what the
forward needs (the chunks, or a decode burst's rows: ids or merged embeddings, positions,
block tables) plus the blocks zeroed for their first use and the copy-on-write block copies
made since the last step, which the other ranks replay first (zeroes, then copies: a block is
zeroed when first handed out, before anything is copied into or out of it). The collectives
inside the forward keep the ranks in step; the other ranks' logits are dropped.

A step that fails on any rank (an error, device memory running out) leaves the ranks inside
different collectives, waiting for each other: no rank can take another step, so that rank says
why in one line and exits, and the others, whose next collective then fails, follow within
seconds (``stop``). Ctrl-C on rank 0 waits for the step in flight to end on every rank before it
interrupts (``_interrupts_after``), so a drained run stays in step.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

import torch

from pipeline.kv import BlockPool
from pipeline.kv.sizing import cache_devices
from pipeline.runner.compiled import CompiledStep
from pipeline.model.tensor_parallel import Group

_RUNNERS = itertools.count()
SAMPLE_EVERY = 64  # steps between two profiled ones (the collective share's samples)
COLLECTIVES = ("allreduce", "all_reduce", "allgather", "all_gather", "wait_tensor", "broadcast", "nccl")


class Mirror:
    """Rank 0's side of one model runner: announced to the other ranks once, then every step."""

    def __init__(self, group: Group, pool: BlockPool, compiled: CompiledStep | None, native: bool) -> None:
        self.group, self.pool, self.id = group, pool, next(_RUNNERS)
        pool.zeroed, pool.copies = [], []
        spec = {
            "num_blocks": pool.num_blocks,
            "block_size": pool.block_size,
            "dtype": pool.dtype,
            "attention": pool.attention,
            "shards": pool.shards,
            "kv_dtype": pool.kv_dtype,
        }
        settings = None if compiled is None else (compiled.backend, compiled.mode)
        self._send(("runner", self.id, spec, settings, native))
        self.steps = 0
        self.sampled_s = 0.0  # wall time of the profiled steps
        self.collective_s = 0.0  # of which in collectives (all-reduces, gathers, this channel's broadcasts)
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start-up chatter (no GPU found...)
        with _profile(cuda=False):  # started now (about a second), not in the middle of a request
            pass

    @property
    def collective_share(self) -> float | None:
        """Share of rank 0's step time spent in collectives, over the steps sampled so far."""
        return self.collective_s / self.sampled_s if self.sampled_s else None

    @contextlib.contextmanager
    def step(self, kind: str, *args: Any) -> Iterator[None]:
        """Around rank 0's ``runner.<kind>(*args)``: first the same call to every other rank, with
        the pool's zeroings and copies since the last step. Every ``SAMPLE_EVERY``-th step runs
        under ``torch.profiler``, whose collective events give the share of the step spent in
        them (sampled: the profiler costs milliseconds a step; the first sample also starts it)."""
        self.steps += 1
        with _interrupts_after(), self._profiled() if self.steps % SAMPLE_EVERY == 1 else contextlib.nullcontext():
            self.pool.prepare_write()  # the step's new blocks zeroed now, so they go with it
            zeroed, self.pool.zeroed = self.pool.zeroed, []
            copies, self.pool.copies = self.pool.copies, []
            self._send((kind, self.id, zeroed, copies, args))
            try:
                yield
            except BaseException as err:  # the other ranks are inside this step's collectives
                failed(self.group, err)

    @contextlib.contextmanager
    def _profiled(self) -> Iterator[None]:
        cuda = any(store.device.type == "cuda" for store in self.pool.stores)
        with _profile(cuda) as prof:
            t0 = time.perf_counter()
            yield
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        spent = sum(
            e.self_device_time_total if cuda else e.self_cpu_time_total
            for e in prof.key_averages()
            if any(c in e.key.lower() for c in COLLECTIVES)
        )
        self.sampled_s += wall
        self.collective_s += min(spent / 1e6, wall)

    def _send(self, message: tuple) -> None:
        try:
            self.group.send(message)
        except RuntimeError as err:  # a rank died: this group cannot take another step
            lost(err)


def _profile(cuda: bool) -> Any:
    from torch.profiler import ProfilerActivity, profile

    # one cycle each (acc_events: no "clears events at the end of each cycle" warning on stderr)
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), acc_events=True)


@contextlib.contextmanager
def _interrupts_after() -> Iterator[None]:
    """Ctrl-C during the block is raised when it ends (on the main thread, where Python delivers
    it; steps driven by another thread, a server's, never see it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple] = []
    before = signal.signal(signal.SIGINT, lambda *frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if caught and before is not signal.SIG_IGN:
            (before if callable(before) else signal.default_int_handler)(*caught[0])


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]


def lost(err: BaseException) -> None:
    """A rank stopped answering: the group is broken."""
    stop(f"lost contact with the other ranks ({first_line(err)})")


def failed(group: Group, err: BaseException) -> None:
    """This rank's step raised while the others run it: their collectives wait for this one."""
    stop(f"rank {group.rank}'s step failed ({type(err).__name__}: {first_line(err)}); the ranks are out of step")


def stop(why: str) -> None:
    """Say why in one line and end this process at once (no cleanup may wait on the group)."""
    print(f"mm-pipeline: tensor parallel: {why}; stopping", file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)


def follow(lm: Any, group: Group, make_runner: Any) -> None:
    """Ranks 1..N-1: run rank 0's steps on this rank's shard until rank 0 says stop.

    ``make_runner(lm, pool, compiled, native)`` builds a ``ModelRunner`` (passed in: the runner
    module imports this one). Ctrl-C reaches every rank of a terminal's launch: here it is
    ignored, and rank 0 drains its requests (which need this rank's shard) and then says stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runners: dict[int, Any] = {}
    while True:
        try:
            message = group.receive()
        except RuntimeError as err:  # rank 0 is gone
            lost(err)
        kind, ident = message[0], message[1]
        if kind == "stop":
            return
        if kind == "runner":
            spec, settings, native = message[2:]
            pool = BlockPool(lm.config, devices=cache_devices(lm), **spec)
            compiled = None if settings is None else CompiledStep(*settings)
            runners[ident] = make_runner(lm, pool, compiled, native)
            continue
        runner = runners[ident]
        zeroed, copies, args = message[2:]
        try:
            with torch.inference_mode():  # as the engine's steps run on rank 0
                runner.pool.zero(zeroed)
                for src, dst in copies:
                    runner.pool.copy_block(src, dst)
                getattr(runner, kind)(*args)
        except Exception as err:  # rank 0 gone mid-step (its collective fails here), or this rank's own failure
            failed(group, err)
