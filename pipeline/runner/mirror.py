"""One engine over many ranks (tensor parallel): rank 0's model runners send each step to the other
ranks, which run the same step on their shards of the weights and their share of the KV heads.

Only rank 0 schedules, so only its pool hands out blocks; a step's message carries what the
forward needs (the chunks, or a decode burst's rows: ids or merged embeddings, positions,
block tables) plus the copy-on-write block copies made since the last step, which the other
ranks replay first. The collectives inside the forward keep the ranks in step; the other ranks'
logits are dropped.
"""
from __future__ import annotations

import itertools
import os
import signal
import sys
from typing import Any

import torch

from pipeline.kv import BlockPool
from pipeline.kv.sizing import cache_devices
from pipeline.runner.compiled import CompiledStep
from pipeline.tensor_parallel import Group

_RUNNERS = itertools.count()


class Mirror:
    """Rank 0's side of one model runner: announced to the other ranks once, then every step."""

    def __init__(self, group: Group, pool: BlockPool, compiled: CompiledStep | None, native: bool) -> None:
        self.group, self.pool, self.id = group, pool, next(_RUNNERS)
        pool.copies = []
        spec = {"num_blocks": pool.num_blocks, "block_size": pool.block_size, "dtype": pool.dtype,
                "attention": pool.attention, "shards": pool.shards}
        settings = None if compiled is None else (compiled.backend, compiled.mode)
        self._send(("runner", self.id, spec, settings, native))

    def step(self, kind: str, *args: Any) -> None:
        """Before rank 0 runs ``runner.<kind>(*args)``: the same call, to every other rank."""
        copies, self.pool.copies = self.pool.copies, []
        self._send((kind, self.id, copies, args))

    def _send(self, message: tuple) -> None:
        try:
            self.group.send(message)
        except RuntimeError as err:  # a rank died: this group cannot take another step
            lost(err)


def lost(err: BaseException) -> None:
    """A rank stopped answering: say so in one line and end this process (the group is broken)."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    print(f"mm-pipeline: tensor parallel: lost contact with the other ranks ({first}); stopping", file=sys.stderr)
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
            pool.replicate()
            compiled = None if settings is None else CompiledStep(*settings)
            runners[ident] = make_runner(lm, pool, compiled, native)
            continue
        runner = runners[ident]
        copies, args = message[2], message[3]
        with torch.inference_mode():  # as the engine's steps run on rank 0
            for src, dst in copies:
                runner.pool.copy_block(src, dst)
            getattr(runner, kind)(*args)
