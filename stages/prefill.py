"""Prefill: compute the prompt's keys/values into the context's KV cache, keeping what is already there.

An engine phase: the engine prefills many requests at once, mixing their chunks with other
sequences' decode steps, and calls this stage's hook for every sequence:

- ``plan_chunk(ctx, start, todo) -> n``: how many prompt tokens the next forward feeds.

Override the hook in a subclass (``stages.prefill._target_=my_pkg.MyPrefill``); a subclass that
overrides ``__call__`` instead is refused before the model loads (the engine never calls it).
"""

from __future__ import annotations

import torch

from pipeline.context import Context
from pipeline.engine import Phases, Sequence
from pipeline.errors import UserError, whole_number
from pipeline.pipeline import shared_engine


class Prefill:
    """Fills the KV cache with the prompt suffix it does not already hold (its own earlier
    tokens or full blocks in the pool's prefix cache); leaves next-token logits in ``ctx.logits``.

    ``chunk_size`` bounds the tokens per forward on long prompts (same output as one pass).
    Driven by hand (``prefill(ctx)`` after the front stages) it runs as a batch of one on the
    model's shared engine.
    """

    def __init__(self, chunk_size: int | None = None) -> None:
        self.chunk_size = (
            None if chunk_size is None else whole_number("prefill.chunk_size", chunk_size, error=ValueError)
        )

    def plan_chunk(self, ctx: Context, start: int, todo: int) -> int:
        """Hook: of the ``todo`` tokens from cache position ``start`` still to compute, how many
        the next forward feeds (at least 1; the engine may cut further for its token budget, and
        never inside a span attended both ways)."""
        return min(todo, self.chunk_size or todo)

    def check_phase(self, name: str) -> None:
        """Refuse a subclass the engine cannot honour (called before the model loads)."""
        if type(self).__call__ is not Prefill.__call__:
            raise UserError(
                f"stages.{name}: {type(self).__name__} overrides __call__, which the engine never calls "
                "(it prefills many requests at once): override plan_chunk instead"
            )

    @torch.inference_mode()
    def __call__(self, ctx: Context) -> Context:
        seq = Sequence(ctx, phases=Phases(prefill=self), prefill_only=True)
        shared_engine(ctx.lm, ctx.cache.pool).run([seq])
        return ctx
