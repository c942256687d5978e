"""Drafters, one per sequence: n-gram prompt lookup and a draft model on its own paged cache."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pipeline.errors import OutOfBlocks
from pipeline.kv import KVCache
from pipeline.runner import Chunk, ModelRunner


class NgramDrafter:
    """Prompt lookup over the sequence's own tokens (prompt and answer so far).

    An index from each n-gram to the latest position it started at (only n-grams followed by
    at least one token), kept up to date as tokens arrive: a lookup is a dict probe per n.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1) -> None:
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self.index: dict[tuple[int, ...], int] = {}
        self.seen = 0  # tokens of ``ids`` indexed so far

    def propose(self, ids: Sequence[int], k: int, sampler: Any = None) -> tuple[list[int], None]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
        n-gram of ``ids``; none when nothing matches. No draft distribution (a point mass)."""
        if len(ids) < self.seen:  # another conversation in the same drafter: start over
            self.index.clear()
            self.seen = 0
        for end in range(max(self.seen, 1), len(ids)):  # n-grams ending at end - 1, followed by ids[end]
            for n in self.sizes:
                if end - n >= 0:
                    self.index[tuple(ids[end - n : end])] = end - n
        self.seen = len(ids)
        for n in self.sizes:
            if n > len(ids):
                continue
            start = self.index.get(tuple(ids[len(ids) - n :]))
            if start is not None:
                return list(ids[start + n : start + n + k]), None
        return [], None

    def close(self) -> None:
        self.index.clear()


class ModelDrafter:
    """A draft model decoding ahead on its own paged cache, in step with the target's tokens."""

    CHUNK = 512  # tokens per catch-up forward (bounds the draft's activation memory)
    CATCH_UP_STEPS = 4  # catch-ups up to this long go token by token on the drafting step

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner  # the draft model on its own pool (its CompiledStep: the greedy burst's)
        self.cache = KVCache(runner.pool)
        self.rows = runner.lm.family.position_rows

    def _feed(self, ids: Sequence[int]) -> torch.Tensor:
        """Run ``ids`` after what the cache holds; the last one's logits [1, V]."""
        logits = None
        for begin in range(0, len(ids), self.CHUNK):
            part = list(ids[begin : begin + self.CHUNK])
            start = self.cache.length
            slots = self.cache.reserve(len(part))
            positions = [list(range(start, start + len(part)))] * self.rows
            chunk = Chunk(table=list(self.cache.blocks), start=start, ids=part, positions=positions, slots=slots)
            logits = self.runner.forward([chunk]).logits
            self.cache.append(part)
        return logits

    def _steps(self, fed: int, steps: int) -> list[int]:
        """Feed ``fed`` and run ``steps`` greedy steps, each chosen token fed straight back
        (``ModelRunner.burst``, compiled or not), one host read at the end: the engine's decode
        burst on the draft's own cache. Writes ``fed`` and the first ``steps - 1`` chosen tokens."""
        start = self.cache.length
        self.cache.reserve(steps)
        out = self.runner.burst([fed], [[start]] * self.rows, [start], [self.cache.blocks], steps)
        tokens = [row[0] for row in out.tokens]
        self.cache.append([fed] + tokens[:-1])
        return tokens

    def _greedy(self, new: Sequence[int], k: int) -> list[int]:
        """Catch up on ``new`` (the target's tokens the draft has not seen), then draft ``k``.
        A short catch-up (the usual one: the target's correction, or the last draft and the
        bonus token) goes one token a step on the same step function as the drafting, so a
        compiled draft never drops to an eager forward; a long one (a new turn) is one chunk."""
        if len(new) > self.CATCH_UP_STEPS:
            self._feed(new[:-1])
        else:
            for token in new[:-1]:
                self._steps(token, 1)
        return self._steps(new[-1], k)

    def propose(self, ids: list[int], k: int, sampler: Any) -> tuple[list[int], torch.Tensor | None]:
        """``k`` drafted tokens and, when sampling, the draft's distribution of each [k, V]."""
        try:
            self.cache.reuse(ids)  # drops its rejected drafts; a new turn starts from the draft's prefix cache
            new = ids[self.cache.length :]  # never empty: reuse leaves one token to compute
            if sampler.greedy:  # drafts are proposals: the draft's own argmax, whatever the target's filters
                return self._greedy(new, k), None
            logits = self._feed(new)
            drafts: list[int] = []
            qs: list[torch.Tensor] = []
            for i in range(k):  # sampling: each draft drawn from q, which the rejection rule needs
                q = torch.softmax(sampler.filtered_logits(logits, [ids + drafts]), dim=-1)[0]
                token = int(sampler.draw(q))
                qs.append(q)
                drafts.append(token)
                if i + 1 < k:
                    logits = self._feed([token])
        except OutOfBlocks:  # the draft pool is full (many sequences): this round goes without drafts
            self.cache.trim()
            return [], None
        return drafts, (torch.stack(qs) if qs else None)

    def close(self) -> None:
        self.cache.clear()
