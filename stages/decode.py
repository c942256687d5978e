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
from pipeline.engine import Sequence, TextStream, fork_sampler
from pipeline.speculative import Speculative

__all__ = ["DecodeLoop", "Speculative", "FastPathFallback", "TextStream"]  # the last two: importable from here since 0.1
from stages.sampler import Sampler


class DecodeLoop:
    """Samples the first token from prefill's logits, then decodes until EOS, a stop string
    or ``max_new_tokens``. Text streams through ``ctx.on_text`` when set.

    ``sampler``: the settings every request starts from (each request draws with its own copy,
    seeded afresh). ``compile``: decode steps run the compiled forward (``pipeline.compiled``);
    ``compile_backend`` (``inductor``, or e.g. ``aot_eager`` to check graph capture without code
    generation) and ``compile_mode`` go to ``torch.compile``. ``speculative``: a ``Speculative``
    (n-gram lookup or a draft model) whose drafts every decode step verifies: same tokens, fewer
    target forwards.
    """

    def __init__(
        self,
        sampler: Callable | None = None,
        compile: bool = False,
        compile_mode: str | None = None,
        compile_backend: str = "inductor",
        speculative: Speculative | None = None,
    ) -> None:
        self.sampler = sampler if sampler is not None else Sampler()
        self.compile = bool(compile)
        self.compiled = CompiledStep(compile_backend, compile_mode) if self.compile else None
        if speculative is not None and not isinstance(speculative, Speculative):
            raise TypeError(f"speculative must be a stages.Speculative, got {type(speculative).__name__}")
        self.speculative = speculative if speculative is not None and speculative.enabled else None

    def attach(self, seq: Sequence) -> Sequence:
        """Give a sequence its own drafter when this stage decodes speculatively."""
        if self.speculative is not None:
            if not isinstance(seq.sampler, Sampler):  # verification needs its filters and random draws
                raise UserError(f"speculative decoding needs a stages.Sampler (got {type(seq.sampler).__name__}): "
                                "set decode.speculative=none to use another sampler")
            seq.spec = self.speculative.drafter()
            seq.num_draft = self.speculative.num_draft
        return seq

    @torch.inference_mode()
    def __call__(self, ctx: Context) -> Context:
        from pipeline.engine import Engine

        if ctx.request.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1 (got {ctx.request.max_new_tokens})")
        if ctx.logits is None:
            raise ValueError("DecodeLoop needs prefill logits: run Prefill on this context first")
        seq = self.attach(Sequence(ctx, fork_sampler(self.sampler)))
        seq.pending = ctx.logits
        Engine(ctx.lm, ctx.cache.pool, max_seqs=1, max_batch_tokens=1 << 30, compiled=self.compiled).run([seq])
        return ctx
