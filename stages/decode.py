"""DecodeLoop: one token per step from the KV cache, the Sampler choosing each token.

The loop itself is the engine's (``pipeline.engine``): a request run through ``Pipeline.run``
decodes in a batch with whatever else is in flight; driven by hand on a prefilled context,
this stage runs the same engine on a batch of one. Either way the host reads each token as it
comes, so EOS, stop strings and streaming act at once.
"""
from __future__ import annotations

from typing import Callable

import torch

from pipeline.context import Context
from pipeline.errors import UserError
from pipeline.compiled import CompiledStep, FastPathFallback
from pipeline.engine import TextStream, fork_sampler

__all__ = ["DecodeLoop", "FastPathFallback", "TextStream"]  # the last two: importable from here since 0.1
from stages.sampler import Sampler


class DecodeLoop:
    """Samples the first token from prefill's logits, then decodes until EOS, a stop string
    or ``max_new_tokens``. Text streams through ``ctx.on_text`` when set.

    ``sampler``: the settings every request starts from (each request draws with its own copy,
    seeded afresh). ``compile``: decode steps run the compiled forward (``pipeline.compiled``);
    ``compile_backend`` (``inductor``, or e.g. ``aot_eager`` to check graph capture without code
    generation) and ``compile_mode`` go to ``torch.compile``.
    """

    def __init__(
        self,
        sampler: Callable | None = None,
        compile: bool = False,
        compile_mode: str | None = None,
        compile_backend: str = "inductor",
    ) -> None:
        self.sampler = sampler if sampler is not None else Sampler()
        self.compile = bool(compile)
        self.compiled = CompiledStep(compile_backend, compile_mode) if self.compile else None

    @torch.inference_mode()
    def __call__(self, ctx: Context) -> Context:
        from pipeline.engine import Engine, Sequence

        if ctx.request.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1 (got {ctx.request.max_new_tokens})")
        if ctx.logits is None:
            raise ValueError("DecodeLoop needs prefill logits: run Prefill on this context first")
        seq = Sequence(ctx, fork_sampler(self.sampler))
        seq.pending = ctx.logits
        Engine(ctx.lm, ctx.cache.pool, max_seqs=1, max_batch_tokens=1 << 30, compiled=self.compiled).run([seq])
        return ctx
