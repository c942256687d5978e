"""The compiled decode step (``decode.compile=true``): the model's one-token forward over the paged
pool under ``torch.compile``, for every decode-only engine step.

gpt-fast's lesson: at small batch the decode step is bound by Python and kernel-launch overhead,
not by arithmetic; compiling the whole forward removes most of it. Two functions are compiled,
with dynamic shapes so that one graph serves every batch size and context length:

- ``forward.greedy_step``: batch built, model run and argmax taken in one call, repeated by the
  engine's decode bursts (greedy rows, nobody waiting) with the token fed straight back;
- ``forward.run_model``: any other decode-only step (sampled rows, requests waiting).

Dynamo specialises sizes 0 and 1, so ``Pipeline.warmup`` runs batches of three, two and one to
build every graph before the first request. Steps with prefill chunks run eagerly. Where the
step cannot be compiled (bitsandbytes weights, a compile error) the engine warns once
(``FastPathFallback``) and stays eager: the tokens are the same either way.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from pipeline.kv import BlockPool
from pipeline.runner.batch import Chunk
from pipeline.runner.forward import forward, greedy_step, greedy_steps, run_model


class FastPathFallback(UserWarning):
    """``decode.compile`` was asked for but this model cannot use it: decoding is eager."""


class CompiledStep:
    """A compiled ``forward.forward`` for decode-only steps, falling back to eager on failure."""

    def __init__(self, backend: str = "inductor", mode: str | None = None) -> None:
        if not torch.cuda.is_available() and hasattr(torch._C, "_ensureCUDADeviceGuardSet"):
            # What dynamo's fake tensors do on first use where CUDA is absent, done here on the
            # creating thread: done first on a driving thread, a later compile on another
            # thread segfaults (torch 2.11 CUDA wheels on a CPU-only machine).
            torch._C._ensureCUDADeviceGuardSet()
        self.backend = backend
        self.mode = mode if backend == "inductor" else None  # modes are inductor options
        self.broken: str | None = None  # why compiling failed, once it did
        self._forward: Any = None  # compiled run_model
        self._greedy: Any = None  # compiled greedy_step
        self._warned = False

    def why_not(self, lm: Any) -> str | None:
        """Why this model cannot take the compiled step (None: it can)."""
        if self.broken:
            return self.broken
        if getattr(lm, "recurrent", False):
            return "linear-attention layers (recurrent states) decode eagerly"
        quantizer = getattr(lm.model, "hf_quantizer", None)
        if quantizer is not None and not getattr(quantizer, "is_compileable", False):
            return f"{lm.quant} quantised weights ({type(quantizer).__name__}) cannot be compiled"
        return None

    def _settings(self, lm: Any) -> dict:
        """``mode`` as asked; on CPU with inductor's default mode, its C++ wrapper: the Python
        wrapper around the generated kernels cost a third of a tiny model's step (measured:
        decode 2.9x -> 3.5-3.9x ``generate()``, warm-up 17 -> 21 s)."""
        if self.mode is None and self.backend == "inductor" and lm.device.type == "cpu":
            return {"options": {"cpp_wrapper": True}}
        return {"mode": self.mode}

    def fallback(self, reason: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"decode.compile: {reason}; decoding uncompiled", FastPathFallback, stacklevel=2)

    def __call__(self, lm: Any, pool: BlockPool, chunks: Sequence[Chunk], device: torch.device | None = None) -> torch.Tensor:
        """``forward.forward`` over decode rows, compiled."""
        return self._run("_forward", run_model, lambda run, _: forward(lm, pool, chunks, run=run, device=device), lm)

    def greedy_steps(self, lm: Any, pool: BlockPool, state: tuple[torch.Tensor, ...], steps: int) -> list[torch.Tensor]:
        """``forward.greedy_steps`` (a decode burst) on the compiled ``greedy_step``.

        Dynamo checks its guards (tensor shapes, strides, the model's attributes) before every
        call, which costs about as much as the kernels of a tiny step. From the third step of a
        burst on, the inputs are the previous step's outputs, shaped and strided exactly like
        the second step's, and nothing else runs in between: those calls skip the guards that
        cannot differ (``skip_guard_eval_unsafe``, which still picks between cached graphs).
        """
        def settled() -> Any:
            return torch.compiler.set_stance(skip_guard_eval_unsafe=True)

        return self._run("_greedy", greedy_step, lambda fn, compiled: greedy_steps(
            lm.model, pool, state, steps, step=fn, settled=settled if compiled else None), lm)

    def _run(self, slot: str, fn: Any, call: Any, lm: Any) -> Any:
        """``call(compiled fn, True)``; ``call(fn, False)`` where compiling is impossible or failed
        (the calls are functional over the pool's slots: rerunning one rewrites the same slots)."""
        reason = self.why_not(lm)
        if reason is not None:
            self.fallback(reason)
            return call(fn, False)
        compiled = getattr(self, slot)
        if compiled is None:
            compiled = torch.compile(fn, backend=self.backend, dynamic=None, **self._settings(lm))
            setattr(self, slot, compiled)
        try:
            return call(compiled, True)
        except Exception as err:  # dynamo/inductor raise many types; all mean "cannot compile this"
            first_line = (str(err).strip().splitlines() or [""])[0][:200]
            self.broken = f"torch.compile failed ({type(err).__name__}: {first_line})"
            self.fallback(self.broken)
            return call(fn, False)
