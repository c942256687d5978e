"""Choosing each row's token: plain argmax rows together, every other row by its own sampler."""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch


def argmax_only(sampler: Any) -> bool:
    """Whether choosing is a plain argmax: no sampler, or one that says so (the built-in greedy
    ``Sampler`` with no penalty and nothing overridden: ``Sampler.argmax_only``). Such rows are
    argmaxed together, on the device, even inside decode bursts; a subclass is always called."""
    return sampler is None or bool(getattr(sampler, "argmax_only", False))


def fork_sampler(sampler: Any) -> Any:
    """A per-sequence copy: same settings, its own random generator (seeded afresh), so a seeded
    request draws the same tokens alone or in any batch."""
    if sampler is None:
        return None
    return sampler.fork() if hasattr(sampler, "fork") else copy.copy(sampler)


def choose(
    logits: torch.Tensor, samplers: Sequence[Any], history: Callable[[int], torch.Tensor]
) -> list[int]:
    """One token id per row of ``logits`` [n, V]. ``history(i)``: row i's ids so far [1, T], for
    samplers that look back (repetition penalty); asked only for rows that call a sampler."""
    n = len(samplers)
    plain = [i for i, s in enumerate(samplers) if argmax_only(s)]
    values: list[int] = [0] * n
    if plain:
        rows = logits if len(plain) == n else logits[plain]
        for i, token in zip(plain, rows.argmax(dim=-1).tolist()):
            values[i] = token
    for i, sampler in enumerate(samplers):
        if not argmax_only(sampler):
            values[i] = int(sampler(logits[i : i + 1], history(i)).reshape(-1)[0])
    return values
