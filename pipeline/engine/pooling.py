"""Embedding a prompt (``Request.pooling``): its final hidden states pooled into one vector.

The sequence is prefill only. Each chunk's forward hands back one pooled row per pooling chunk
(``Chunk.pool``: the chunk's last row, its first, or the sum of its rows; ``runner.forward_pooled``), on the device; the
rows are added up here as the chunks come (a long prompt prefills in several), and the result is
L2-normalised when the request ends. "last" needs only the prompt's last token, which is always
computed, so a prompt whose prefix is cached reuses it; "mean" and "cls" need every row (or the
first), so such a prompt is computed whole (``Sequence.reusable``).
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.context import POOLINGS
from pipeline.errors import UserError


def check(request: Any) -> None:
    """The request's pooling is one we know, and nothing it asks needs a decode."""
    if request.pooling not in POOLINGS:
        raise UserError(f"pooling must be one of {', '.join(POOLINGS)} (got {request.pooling!r})")
    if request.logprobs is not None or request.prompt_logprobs is not None:
        raise UserError("an embedding request has no log-probabilities (pooling and logprobs together)")


def chunk_pool(request: Any, begin: int, end: int, prompt_len: int) -> str | None:
    """What a chunk over [begin, end) hands back: "sum" of its rows, its "first" or its "last"
    row, or None (a chunk that pools nothing: "cls" past the first token, "last" before the end)."""
    pooling = request.pooling
    if pooling == "mean":
        return "sum"
    if pooling == "cls":
        return "first" if begin == 0 else None
    if pooling == "last":
        return "last" if end == prompt_len else None
    return None


def add(ctx: Any, row: torch.Tensor, begin: int) -> None:
    """A chunk's pooled row into the sequence's running sum (on the device: nothing waits). A
    chunk from position 0 starts the sum afresh: after a preemption the prompt is computed again."""
    ctx.pooled = row if ctx.pooled is None or begin == 0 else ctx.pooled + row


def embedding(ctx: Any) -> list[float]:
    """The finished sequence's embedding: the pooled rows (averaged for "mean"), L2-normalised."""
    if ctx.pooled is None:
        raise UserError("the prompt was embedded from a cache that held all of it: nothing was pooled")
    vector = ctx.pooled.cpu()
    if ctx.request.pooling == "mean":
        vector = vector / int(ctx.input_ids.shape[1])
    return torch.nn.functional.normalize(vector, dim=0).tolist()
