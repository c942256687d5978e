"""The model runner: the model, the pool's device tensors and the step, in one object.

Everything that touches the model during a step goes through here, so this is the one place
that decides compiled or eager (``decode.compile``: one-token decode steps on the compiled
step, everything else eager; a model that cannot compile falls back with one warning), and
the one place a tensor-parallel step is sent to the other ranks (``mirror``; CUDA graphs by
bucket live in ``compiled``).
The engine hands it chunks and gets logits (``forward``) or, for a greedy decode burst, the
chosen tokens (``burst``).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pipeline import tensor_parallel
from pipeline.kv import BlockPool
from pipeline.runner import matvec
from pipeline.runner.batch import Chunk
from pipeline.runner.compiled import CompiledStep
from pipeline.runner.forward import burst_state, forward, run_burst, single_row_step
from pipeline.runner.mirror import Mirror
from pipeline.transfer import read


@dataclass
class StepOutput:
    """What one model step gave back: next-token logits of the chunks that asked for them (in
    chunk order), or a burst's chosen tokens [steps][rows]; the seconds per step and whether
    the compiled step ran.

    A forward's logits may still be computing when it returns (nothing waited for them): its
    ``seconds`` are set by whoever reads its result (``finish_timing``), from ``started``."""

    logits: torch.Tensor | None
    tokens: list[list[int]] | None
    seconds: float
    compiled: bool
    started: float = 0.0

    def finish_timing(self) -> None:
        """The step's wall time, once its result has been read back (or waited for)."""
        self.seconds = time.perf_counter() - self.started


class ModelRunner:
    """Runs packed forwards of one model over one KV pool (``compiled``: a ``CompiledStep`` for
    one-token decode steps, or None; ``native``: one-row linear layers on the native CPU kernel,
    ``pipeline.runner.matvec``, where it applies)."""

    def __init__(self, lm: Any, pool: BlockPool, compiled: CompiledStep | None = None, native: bool = True) -> None:
        self.lm = lm
        self.pool = pool
        self.compiled = compiled
        self.device = lm.device  # (a property that walks the parameters: read once)
        self.native = native and self.device.type == "cpu" and matvec.ready(lm.model)
        # Tensor parallel, on rank 0: every step is sent to the other ranks first (``mirror``).
        group = tensor_parallel.current() if getattr(lm, "tp", 1) > 1 else None
        self.mirror = Mirror(group, pool, compiled, native) if group is not None and group.driver else None

    @property
    def compiles(self) -> bool:
        """Whether one-token decode steps run compiled (asked for, and this model can)."""
        return self.compiled is not None and self.compiled.why_not(self.lm) is None

    def forward(self, chunks: Sequence[Chunk]) -> StepOutput:
        """One packed forward, launched: compiled when every chunk is a single token (a decode
        step). Nothing waits here; the caller's read of the logits does (``StepOutput.finish_timing``)."""
        t0 = time.perf_counter()
        use_compiled = self.compiled is not None and all(c.count == 1 for c in chunks)
        run = self.compiled if use_compiled else self._eager
        with self._mirrored("forward", chunks), matvec.active(self.native):
            logits = run(self.lm, self.pool, chunks, device=self.device)
        return StepOutput(logits, None, 0.0, use_compiled and self.compiles, started=t0)

    def _mirrored(self, kind: str, *args: Any) -> Any:
        """Tensor parallel, on rank 0: the step sent to the other ranks first (``Mirror.step``)."""
        return contextlib.nullcontext() if self.mirror is None else self.mirror.step(kind, *args)

    @property
    def collective_share(self) -> float | None:
        """Tensor parallel: share of rank 0's sampled step time spent in collectives (else None)."""
        return None if self.mirror is None else self.mirror.collective_share

    @staticmethod
    def _eager(lm: Any, pool: BlockPool, chunks: Sequence[Chunk], device: torch.device) -> torch.Tensor:
        return forward(lm, pool, chunks, device=device)

    def burst(
        self, fed: Sequence[int], positions: Sequence[Sequence[int]], starts: Sequence[int],
        tables: Sequence[Sequence[int]], steps: int,
    ) -> StepOutput:
        """``steps`` greedy decode steps for rows that each feed one token (``fed`` at
        ``positions``, cache lengths ``starts``, block tables covering every slot written),
        each chosen token fed straight back; one host read at the end."""
        with self._mirrored("burst", fed, positions, starts, tables, steps):
            state = burst_state(self.pool, fed, positions, starts, tables, steps, self.device, bucketed=self.compiles)
            t0 = time.perf_counter()
            step = None if self.compiled is not None else single_row_step(self.pool, tables, starts, steps)
            with matvec.active(self.native):
                chosen = run_burst(self.lm, self.pool, state, steps, self.compiled, step)
            tokens = read(torch.cat(chosen))  # [steps][rows]: the one host read of the burst
        return StepOutput(None, tokens, (time.perf_counter() - t0) / steps, self.compiles)
