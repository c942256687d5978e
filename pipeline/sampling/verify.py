"""Speculative verification: which drafted tokens the target keeps (exact for greedy and for
sampling: the standard rejection rule, with each request's own sampler)."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.sampling.choose import argmax, argmax_only
from pipeline.transfer import read


def verify(
    sampler: Any,
    logits: torch.Tensor,
    drafts: list[int],
    q: torch.Tensor | None,
    history: list[int],
    outputs: list[int] | None = None,
) -> tuple[list[int], int]:
    """The tokens to keep, and how many of them are accepted drafts.

    ``logits`` [len(drafts) + 1, V]: row i is the target's prediction after the i-th draft (row 0
    after the last accepted token). The kept tokens are the accepted drafts, then one token of
    the target's own: the correction at the first rejection, or a bonus token when all pass.
    ``q``: the draft's distributions ([len(drafts), V]); None means each draft was certain (a
    point mass: n-gram lookup, or a greedy draft model). Plain greedy (argmax, no filters) is
    compared in one go. ``history``: the ids so far; ``outputs``: the generated ones (presence and
    frequency penalties; default ``history``).
    """
    if argmax_only(sampler):
        best = read(argmax(logits))
        m = 0
        while m < len(drafts) and drafts[m] == best[m]:
            m += 1
        return drafts[:m] + [best[m]], m
    out: list[int] = []
    for i in range(len(drafts) + 1):
        scores = sampler.filtered_logits(
            logits[i : i + 1], [history + out], [(history if outputs is None else outputs) + out]
        )[0]
        if sampler.greedy:
            token = int(scores.argmax())
            out.append(token)
            if i == len(drafts) or token != drafts[i]:
                return out, i
            continue
        p = torch.softmax(scores, dim=-1)
        if i == len(drafts):  # every draft accepted: the bonus token, from the target alone
            out.append(int(sampler.draw(p)))
            return out, i
        d = drafts[i]
        qd = 1.0 if q is None else float(q[i, d])
        if sampler.uniform(p.device) * qd < float(p[d]):  # u < p(d) / q(d)
            out.append(d)
            continue
        if q is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - q[i].to(p.device, p.dtype)).clamp_min(0.0)
        total = float(residual.sum())
        out.append(int(sampler.draw(residual / total if total > 0 else p)))
        return out, i
    raise AssertionError("unreachable")
