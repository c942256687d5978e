"""Prefill: compute the prompt's keys/values into the context's KV cache, keeping what is already there."""
from __future__ import annotations

import torch

from pipeline.context import Context
from pipeline.errors import whole_number


class Prefill:
    """Fills the KV cache with the prompt suffix it does not already hold (its own earlier
    tokens or full blocks in the pool's prefix cache); leaves next-token logits in ``ctx.logits``.

    ``chunk_size`` bounds the tokens per forward on long prompts (same output as one pass);
    the engine also uses it for the prefill chunks it mixes with other sequences' decode steps.
    Driven by hand it runs through the engine as a batch of one.
    """

    def __init__(self, chunk_size: int | None = None) -> None:
        self.chunk_size = (
            None if chunk_size is None else whole_number("prefill.chunk_size", chunk_size, error=ValueError)
        )

    @torch.inference_mode()
    def __call__(self, ctx: Context) -> Context:
        from pipeline.engine import Engine, Sequence

        seq = Sequence(ctx, sampler=None, prefill_only=True, chunk_size=self.chunk_size)
        Engine(ctx.lm, ctx.cache.pool, max_seqs=1, max_batch_tokens=1 << 30).run([seq])
        return ctx
