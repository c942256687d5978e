"""The compiled decode step (``decode.compile=true``): the model's one-token forward over the paged
pool under ``torch.compile``, for every decode-only engine step.

gpt-fast's lesson: at small batch the decode step is bound by Python and kernel-launch overhead,
not by arithmetic; compiling the whole forward removes most of it. Here the compiled function is
the model call (``paged.run_model``) on decode rows (one new token per sequence), with dynamic shapes, so one
graph serves every batch size and context length (sizes 0 and 1 are specialised by dynamo:
``Pipeline.warmup`` runs a batch of one and a batch of two so that both exist before the first
request). Steps with prefill chunks run eagerly. Where the step cannot be compiled
(bitsandbytes weights, a compile error) the engine warns once (``FastPathFallback``) and stays
eager: the tokens are the same either way.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from pipeline.paged import BlockPool, Chunk, forward, run_model


class FastPathFallback(UserWarning):
    """``decode.compile`` was asked for but this model cannot use it: decoding is eager."""


class CompiledStep:
    """A compiled ``paged.forward`` for decode-only steps, falling back to eager on failure."""

    def __init__(self, backend: str = "inductor", mode: str | None = None) -> None:
        if not torch.cuda.is_available() and hasattr(torch._C, "_ensureCUDADeviceGuardSet"):
            # What dynamo's fake tensors do on first use where CUDA is absent, done here on the
            # creating thread: done first on a driving thread, a later compile on another
            # thread segfaults (torch 2.11 CUDA wheels on a CPU-only machine).
            torch._C._ensureCUDADeviceGuardSet()
        self.backend = backend
        self.mode = mode if backend == "inductor" else None  # modes are inductor options
        self.broken: str | None = None  # why compiling failed, once it did
        self._fn: Any = None
        self._warned = False

    def why_not(self, lm: Any) -> str | None:
        """Why this model cannot take the compiled step (None: it can)."""
        if self.broken:
            return self.broken
        quantizer = getattr(lm.model, "hf_quantizer", None)
        if quantizer is not None and not getattr(quantizer, "is_compileable", False):
            return f"{lm.quant} quantised weights ({type(quantizer).__name__}) cannot be compiled"
        return None

    def fallback(self, reason: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"decode.compile: {reason}; decoding uncompiled", FastPathFallback, stacklevel=2)

    def __call__(self, lm: Any, pool: BlockPool, chunks: Sequence[Chunk], device: torch.device | None = None) -> torch.Tensor:
        reason = self.why_not(lm)
        if reason is not None:
            self.fallback(reason)
            return forward(lm, pool, chunks, device=device)
        if self._fn is None:
            self._fn = torch.compile(run_model, backend=self.backend, mode=self.mode, dynamic=None)
        try:
            return forward(lm, pool, chunks, run=self._fn, device=device)
        except Exception as err:  # dynamo/inductor raise many types; all mean "cannot compile this"
            first_line = (str(err).strip().splitlines() or [""])[0][:200]
            self.broken = f"torch.compile failed ({type(err).__name__}: {first_line})"
            self.fallback(self.broken)
            return forward(lm, pool, chunks, device=device)  # the slots are rewritten: nothing half-done remains
