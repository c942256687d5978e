"""Speculative decoding: draft k tokens cheaply, verify them in one forward of the target.

Why: a decode step reads every weight to produce one token. Verifying k drafted tokens costs
about one step while the batch is small, so each accepted draft is a step saved. It stays
exact:

- greedy keeps a draft only where the target's own argmax agrees;
- sampling keeps draft d with probability min(1, p(d) / q(d)), else draws from the residual
  max(0, p - q) (Leviathan et al. 2023; Chen et al. 2023), so every kept token has the
  target's distribution;
- the forward wrote keys and values for every draft: the rejected ones leave the target's
  cache with ``KVCache.rollback``.

Drafters, one per sequence:

- ``NgramDrafter``: prompt lookup (Saxena 2023; MNN's lookahead). The tokens that followed the
  latest earlier occurrence of the last n tokens, n from ``ngram_max`` down to ``ngram_min``.
  Free to run; it shines where the answer copies its input (summaries, QA, code edits).
- ``ModelDrafter``: a smaller model that shares the tokenizer, with its own paged KV cache.
  Each round it rolls back to what it shares with the target's tokens (``KVCache.reuse``,
  which also finds earlier turns in the draft pool's prefix cache), feeds the accepted ones,
  and drafts greedily, or by sampling (keeping q for the rejection rule).

The engine (``pipeline.engine``) asks the drafter for k tokens when a sequence is decoding,
verifies them in the same packed forward as every other sequence's step, and calls ``verify``.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from pipeline.errors import UserError

METHODS = ("none", "ngram", "draft")


class Speculative:
    """The settings: ``method`` none | ngram | draft, ``num_draft`` tokens per round, the n-gram
    sizes, and for ``draft`` the loaded draft model (``pipeline.load_model``) and whether its
    greedy drafting steps are compiled (``compile``; ``compile_backend`` as in ``DecodeLoop``).
    One instance serves every sequence (``drafter()`` makes each its own state); the draft
    model's KV pool is made on first use and shared by their caches."""

    def __init__(self, method: str = "none", num_draft: int = 4, ngram_max: int = 3, ngram_min: int = 1,
                 draft: Any = None, draft_memory: float | int | str | None = None, compile: bool = False,
                 compile_backend: str = "inductor") -> None:
        check_settings(method, num_draft, ngram_max, ngram_min, has_draft=draft is not None)
        if draft is not None:
            refuse_recurrent_draft(draft)
        self.method = method
        self.num_draft = int(num_draft)
        self.ngram_max, self.ngram_min = int(ngram_max), int(ngram_min)
        self.draft = draft
        self.draft_memory = draft_memory
        self._pool = None
        # The draft's greedy steps under torch.compile (decode.draft_compile). Why: a small
        # draft's eager step is mostly per-call overhead, so it costs nearly what the target's
        # does and drafting cannot pay (CPU: the benchmark's 256-wide draft 2.4 ms eager, 0.7 ms
        # compiled).
        self.compiled = None
        if compile and method == "draft":
            from pipeline.compiled import CompiledStep

            self.compiled = CompiledStep(compile_backend)

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def __repr__(self) -> str:
        return (f"Speculative(method={self.method!r}, num_draft={self.num_draft}, ngram_max={self.ngram_max}, "
                f"ngram_min={self.ngram_min}, compile={self.compiled is not None})")

    def drafter(self) -> "NgramDrafter | ModelDrafter | None":
        if self.method == "ngram":
            return NgramDrafter(self.ngram_max, self.ngram_min)
        if self.method == "draft":
            if self._pool is None:
                from pipeline.paged import pool_for

                self._pool = pool_for(self.draft, self.draft_memory)
            return ModelDrafter(self.draft, self._pool, self.compiled)
        return None


def refuse_recurrent_draft(draft: Any) -> None:
    """A draft model drafts in decode bursts over its own cache, which recurrent states do not
    support: a draft with linear-attention layers is refused in one line (as a target it works)."""
    if getattr(draft, "recurrent", False):
        raise UserError("decode.draft_model has linear-attention layers (recurrent states, e.g. Qwen3.5): a draft "
                        "model must be an attention-only model; use decode.speculative=ngram or another draft")


def check_settings(method: str, num_draft: Any, ngram_max: Any, ngram_min: Any, *, has_draft: bool) -> None:
    """The rules of ``decode.speculative`` and its companions; one line naming the setting."""
    from pipeline.errors import whole_number

    if method not in METHODS:
        raise UserError(f"decode.speculative must be one of {', '.join(METHODS)} (got {method!r})")
    whole_number("decode.num_draft", num_draft)
    whole_number("decode.ngram_max", ngram_max)
    whole_number("decode.ngram_min", ngram_min)
    if int(ngram_min) > int(ngram_max):
        raise UserError(f"decode.ngram_min ({ngram_min}) is above decode.ngram_max ({ngram_max})")
    if method == "draft" and not has_draft:
        raise UserError("decode.speculative=draft needs a draft model: set decode.draft_model=DIR_OR_HUB_ID")


def check_same_tokenizer(target: Any, draft: Any, name: str = "decode.draft_model") -> None:
    """Refuse a draft model whose token ids mean something else (its drafts would be noise, and
    a larger vocabulary could even name ids the target does not have)."""
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv != dv:
        differ = sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])[:3]
        raise UserError(f"{name} has another tokenizer than the target model ({len(dv)} vs {len(tv)} tokens; "
                        f"first differences: {differ}): the draft must share the target's tokenizer")


# --------------------------------------------------------------------------------------
# Drafters
# --------------------------------------------------------------------------------------


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

    def __init__(self, lm: Any, pool: Any, compiled: Any = None) -> None:
        from pipeline.kv_cache import KVCache

        self.lm = lm
        self.pool = pool
        self.cache = KVCache(pool)
        self.rows = lm.family.position_rows
        self.device = lm.device
        self.compiled = compiled  # a CompiledStep for the greedy burst, or None (eager)

    def _feed(self, ids: Sequence[int]) -> torch.Tensor:
        """Run ``ids`` after what the cache holds; the last one's logits [1, V]."""
        from pipeline.paged import Chunk, forward

        logits = None
        for begin in range(0, len(ids), self.CHUNK):
            part = list(ids[begin : begin + self.CHUNK])
            start = self.cache.length
            slots = self.cache.reserve(len(part))
            positions = [list(range(start, start + len(part)))] * self.rows
            chunk = Chunk(table=list(self.cache.blocks), start=start, ids=part, positions=positions, slots=slots)
            logits = forward(self.lm, self.pool, [chunk], device=self.device)
            self.cache.append(part)
        return logits

    def _steps(self, fed: int, steps: int) -> list[int]:
        """Feed ``fed`` and run ``steps`` greedy steps, each chosen token fed straight back
        (``paged.greedy_steps``, compiled or not), one host read at the end: the engine's decode
        burst on the draft's own cache. Writes ``fed`` and the first ``steps - 1`` chosen tokens."""
        from pipeline.paged import burst_state, run_burst

        start = self.cache.length
        self.cache.reserve(steps)
        state = burst_state(self.pool, [fed], [[start]] * self.rows, [start], [self.cache.blocks], steps, self.device)
        chosen = run_burst(self.lm, self.pool, state, steps, self.compiled)
        tokens = torch.cat(chosen).view(-1).tolist()
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
        from pipeline.paged import OutOfBlocks

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


# --------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------


def verify(sampler: Any, logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
           history: list[int]) -> tuple[list[int], int]:
    """The tokens to keep, and how many of them are accepted drafts.

    ``logits`` [len(drafts) + 1, V]: row i is the target's prediction after the i-th draft (row 0
    after the last accepted token). The kept tokens are the accepted drafts, then one token of
    the target's own: the correction at the first rejection, or a bonus token when all pass.
    ``q``: the draft's distributions ([len(drafts), V]); None means each draft was certain (a
    point mass: n-gram lookup, or a greedy draft model). Plain greedy (argmax, no filters) is
    compared in one go.
    """
    from pipeline.engine import plain_greedy

    if plain_greedy(sampler):
        best = logits.argmax(dim=-1).tolist()
        m = 0
        while m < len(drafts) and drafts[m] == best[m]:
            m += 1
        return drafts[:m] + [best[m]], m
    out: list[int] = []
    for i in range(len(drafts) + 1):
        scores = sampler.filtered_logits(logits[i : i + 1], [history + out])[0]
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


def draft_budget(num_draft: int, generated: int, max_new_tokens: int, budget: int) -> int:
    """Drafts this round: never past ``max_new_tokens`` (the round also yields one token of the
    target's own) nor past the step's token budget (the chunk is the drafts plus one)."""
    return max(0, min(num_draft, max_new_tokens - generated - 1, budget - 1))

