"""The model runner: the model, the pool's device tensors and the step, in one object.

Everything that touches the model during a step goes through here, so this is the one place
that decides how a one-token decode step runs: compiled (``decode.compile``), replayed as CUDA
graphs (``decode.cuda_graphs``, on CUDA) or eager; everything else is eager, and a model that
cannot take the fixed-shape step falls back with one warning. It is also the one place a
tensor-parallel step is sent to the other ranks (``mirror``; the buckets live in ``compiled``
and ``graphs``).
The engine hands it chunks and gets logits (``forward``) or, for a greedy decode burst, the
chosen tokens (``burst``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pipeline.model import tensor_parallel
from pipeline.kv import BlockPool
from pipeline.runner import compile_ahead, fused, inductor_cache, lora, matvec
from pipeline.runner.attention import attach
from pipeline.runner.paged_batch import Chunk
from pipeline.runner.compiled import CompiledStep
from pipeline.runner.forward import burst_state, forward, forward_pooled, run_burst, single_row_step
from pipeline.runner.graphs import GraphedStep
from pipeline.runner.mirror import Mirror
from pipeline.transfer import read


@dataclass
class StepOutput:
    """What one model step gave back: next-token logits of the chunks that asked for them (in
    chunk order), or a burst's chosen tokens [steps][rows]; the seconds per step and whether
    the compiled step ran (``compiled``) or CUDA graphs replayed it (``graphed``).

    A forward's logits may still be computing when it returns (nothing waited for them): its
    ``seconds`` are set by whoever reads its result (``finish_timing``), from ``started``."""

    logits: torch.Tensor | None
    tokens: list[list[int]] | None
    seconds: float
    compiled: bool
    started: float = 0.0
    graphed: bool = False
    pooled: list[torch.Tensor | None] | None = None  # per chunk, its pooled row (Chunk.pool; None: none)

    def finish_timing(self) -> None:
        """The step's wall time, once its result has been read back (or waited for)."""
        self.seconds = time.perf_counter() - self.started


class ModelRunner:
    """Runs packed forwards of one model over one KV pool (``compiled``: the fixed-shape step for
    one-token decode steps, a ``CompiledStep`` or a ``GraphedStep`` (used where it ``applies``:
    CUDA), or None; ``native``: one-row linear layers on the native CPU kernel,
    ``pipeline.runner.matvec``, where it applies)."""

    def __init__(
        self, lm: Any, pool: BlockPool, compiled: CompiledStep | GraphedStep | None = None, native: bool = True
    ) -> None:
        self.lm = lm
        self.pool = pool
        self.device = lm.device  # (a property that walks the parameters: read once)
        self.compiled = compiled if compiled is None or compiled.applies(self.device) else None
        self.native = native and self.device.type == "cpu" and matvec.ready(lm.model)
        if self.native:
            fused.attach(lm.model)  # its norms and rotations too, where transformers declares them standard
        # Tensor parallel, on rank 0: every step is sent to the other ranks first (``mirror``).
        group = tensor_parallel.current() if getattr(lm, "tp", 1) > 1 else None
        # (Ranks decode a CUDA-graphed step eagerly: ``GraphedStep.why_not``.)
        if isinstance(self.compiled, CompiledStep) and self.compiled.auto:
            if self._auto_compiles(group):
                compile_ahead.trace_fx_once()  # before this engine's first step (``compile_ahead``)
            else:
                self.compiled = None
        self._starting = threading.Lock()  # compile_ahead
        compiled_tp = self.compiled if isinstance(self.compiled, CompiledStep) else None
        self.mirror = Mirror(group, pool, compiled_tp, native) if group is not None and group.driver else None

    def _auto_compiles(self, group: Any) -> bool:
        """``decode.compile=auto``: whether to build the compiled step here: on one CPU process with
        the native kernels (their one-row linear layers are what Inductor's graph calls; without
        them a compiled step reads every weight as PyTorch does) and a model that compiles."""
        return self.native and group is None and self.compiled.why_not(self.lm) is None

    def compile_ahead(self, rows: int | None = None, said: Any = None, apart: bool = False) -> threading.Thread | None:
        """``decode.compile=auto``: build the compiled step's graphs beside the engine
        (``pipeline.runner.compile_ahead``) while steps run eagerly here; the runner takes the
        compiled step from the first step after they are ready. Returns the build's thread, the
        one started before if any (``rows`` and ``said`` then unused); None: nothing runs beside
        (no auto step, or it was built here). ``said``: told one line when it ends. ``apart``: a
        first compile in a process of its own (``compile_ahead.start``)."""
        step = self.compiled
        if not isinstance(step, CompiledStep):
            return None
        with self._starting:  # first requests submitted at once from many threads start one build
            if step.auto and step.builder is None and not step.ready.is_set():
                if not self.lm.model.__dict__.get("_mm_paged_attached"):
                    attach(self.lm.model)  # here, once: never on two threads at once
                step.builder = compile_ahead.start(step, self.lm, self.pool, rows, self.native, said, apart)
        return step.builder

    def compile_record(self, rows: int | None = None) -> dict[str, Any]:
        """What Inductor's cache folder knows of this runner's auto compile for ``rows``
        (``inductor_cache.compile_record``); empty without an auto step."""
        step = self.compiled
        if not isinstance(step, CompiledStep) or not step.auto:
            return {}
        return inductor_cache.compile_record(step.key(self.lm, self.pool, rows))

    def note_eager_step(self, seconds: float, rows: int | None = None) -> None:
        """Record what an eager decode step of this model took (``compile_record``'s
        ``eager_token_s``): what a later run weighs a cached compile's wait against."""
        step = self.compiled
        if isinstance(step, CompiledStep) and step.auto:
            inductor_cache.remember(step.key(self.lm, self.pool, rows), eager_token_s=seconds)

    def _fixed(self) -> CompiledStep | GraphedStep | None:
        """The fixed-shape step where this model takes it (an auto compile: once built); else
        None, having said once why not."""
        if self.compiled is None or (isinstance(self.compiled, CompiledStep) and not self.compiled.ready.is_set()):
            return None
        reason = self.compiled.why_not(self.lm)
        if reason is not None:
            self.compiled.fallback(reason)
            return None
        return self.compiled

    def decode_kind(self) -> dict:
        """What the next decode step runs, for the engine's figures: ``decode_compiled`` /
        ``decode_cuda_graphs`` (the fixed-shape step is built and usable) and ``decode_compile_s``
        (what its build took, None until built). Nothing is said or started here."""
        fixed = self.compiled
        if isinstance(fixed, CompiledStep) and not fixed.ready.is_set():
            fixed = None
        ran = self._ran(fixed)
        built = fixed.built_s if isinstance(fixed, CompiledStep) and ran["compiled"] else None
        return {"decode_compiled": ran["compiled"], "decode_cuda_graphs": ran["graphed"], "decode_compile_s": built}

    def _ran(self, fixed: CompiledStep | GraphedStep | None) -> dict:
        """StepOutput's ``compiled`` and ``graphed``: the fixed-shape step taken, if it did not fail
        during the step (a failed compile or capture ran eagerly)."""
        kind = fixed.kind if fixed is not None and fixed.why_not(self.lm) is None else None
        return {"compiled": kind == CompiledStep.kind, "graphed": kind == GraphedStep.kind}

    def forward(self, chunks: Sequence[Chunk]) -> StepOutput:
        """One packed forward, launched: on the fixed-shape step when every chunk is a single token
        (a decode step). Nothing waits here; the caller's read of the logits does
        (``StepOutput.finish_timing``)."""
        t0 = time.perf_counter()
        pooling = any(c.pool for c in chunks)
        plan = lora.plan_for(self.lm, [c.adapter for c in chunks], [c.count for c in chunks], self.device)
        fixed = self._fixed() if all(c.count == 1 for c in chunks) and not pooling and plan is None else None
        run = fixed or self._eager
        pooled = None
        with self._mirrored("forward", chunks), matvec.active(self.native), lora.applied(plan):
            if pooling:
                logits, pooled = forward_pooled(self.lm, self.pool, chunks, device=self.device)
            else:
                logits = run(self.lm, self.pool, chunks, device=self.device)
        return StepOutput(logits, None, 0.0, started=t0, pooled=pooled, **self._ran(fixed))

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
        self,
        fed: Sequence[int],
        positions: Sequence[Sequence[int]],
        starts: Sequence[int],
        tables: Sequence[Sequence[int]],
        steps: int,
        adapters: Sequence[Any] = (),
    ) -> StepOutput:
        """``steps`` greedy decode steps for rows that each feed one token (``fed`` at
        ``positions``, cache lengths ``starts``, block tables covering every slot written),
        each chosen token fed straight back; one host read at the end. ``adapters``: each row's
        LoRA adapter (none given: the base model); rows with one run eagerly."""
        plan = lora.plan_for(self.lm, adapters, [1] * len(adapters), self.device) if adapters else None
        with self._mirrored("burst", fed, positions, starts, tables, steps):
            fixed = self._fixed() if plan is None else None
            state = burst_state(
                self.pool, fed, positions, starts, tables, steps, self.device, bucketed=fixed is not None
            )
            t0 = time.perf_counter()
            step = None if fixed is not None else single_row_step(self.pool, tables, starts, steps)
            with matvec.active(self.native), lora.applied(plan):
                chosen = run_burst(self.lm, self.pool, state, steps, fixed, step)
            tokens = read(torch.cat(chosen))  # [steps][rows]: the one host read of the burst
        return StepOutput(None, tokens, (time.perf_counter() - t0) / steps, **self._ran(fixed))
