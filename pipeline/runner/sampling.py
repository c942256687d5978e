"""Choosing each row's token: plain argmax rows together, every other row by its own sampler."""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch

from pipeline.transfer import read


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
    samplers that look back (repetition penalty); asked only for rows that call a sampler.

    Argmax rows are chosen together; every other row by its own sampler (its own generator, so
    a seeded row draws the same alone or in any batch). The chosen ids stay on the device until
    one read for the whole batch: a step waits for the device once, however many rows sample."""
    plain = [i for i, s in enumerate(samplers) if argmax_only(s)]
    order, parts = [], []
    if plain:
        parts.append((logits if len(plain) == len(samplers) else logits[plain]).argmax(dim=-1))
        order += plain
    for i, sampler in enumerate(samplers):
        if not argmax_only(sampler):
            token = sampler(logits[i : i + 1], history(i))
            parts.append(torch.as_tensor(token, device=logits.device).reshape(-1)[:1].long())
            order.append(i)
    values = [0] * len(samplers)
    for i, token in zip(order, read(torch.cat(parts))):
        values[i] = token
    return values
