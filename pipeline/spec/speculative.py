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

import time
from typing import Any

from pipeline.errors import UserError, whole_number
from pipeline.kv import BlockPool, pool_for
from pipeline.runner import CompiledStep, ModelRunner
from pipeline.spec.drafters import ModelDrafter, NgramDrafter

METHODS = ("none", "ngram", "draft")


class Speculative:
    """The settings: ``method`` none | ngram | draft, ``num_draft`` tokens per round, the n-gram
    sizes, and for ``draft`` the loaded draft model (``pipeline.load_model``) and whether its
    greedy drafting steps are compiled (``compile``; ``compile_backend`` as in ``DecodeLoop``).
    One instance serves every sequence (``drafter()`` makes each its own state); the draft
    model's KV pool is shared by their caches: the one its target's ``Pipeline`` sized with its
    own from one budget (``use_pool``), else one sized by ``draft_memory`` on first use."""

    def __init__(
        self,
        method: str = "none",
        num_draft: int = 4,
        ngram_max: int = 3,
        ngram_min: int = 1,
        draft: Any = None,
        draft_memory: float | int | str | None = None,
        compile: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        check_settings(method, num_draft, ngram_max, ngram_min, has_draft=draft is not None)
        if draft is not None:
            refuse_recurrent_draft(draft)
        self.method = method
        self.num_draft = int(num_draft)
        self.ngram_max, self.ngram_min = int(ngram_max), int(ngram_min)
        self.draft = draft
        self.draft_memory = draft_memory
        self._runner: ModelRunner | None = None  # the draft model on its own pool, made on first use
        self.pool: BlockPool | None = None  # the draft's pool when sized with the target's (use_pool)
        # The draft's greedy steps under torch.compile (decode.draft_compile). Why: a small
        # draft's eager step is mostly per-call overhead, so it costs nearly what the target's
        # does and drafting cannot pay (CPU: the benchmark's 256-wide draft 2.4 ms eager, 0.7 ms
        # compiled).
        self.compiled = None
        if compile and method == "draft":
            self.compiled = CompiledStep(compile_backend)

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def __repr__(self) -> str:
        return (
            f"Speculative(method={self.method!r}, num_draft={self.num_draft}, ngram_max={self.ngram_max}, "
            f"ngram_min={self.ngram_min}, compile={self.compiled is not None})"
        )

    @property
    def shares_budget(self) -> bool:
        """Whether the draft model's pool should come out of its target's ``kv.memory`` budget
        (``pipeline.kv.pools_for``): a draft model with no ``draft_memory`` of its own and no
        pool yet."""
        return self.method == "draft" and self.draft is not None and self.draft_memory is None and self._runner is None

    def use_pool(self, pool: BlockPool) -> None:
        """Draft on ``pool`` (sized with the target's pool from one budget) instead of sizing
        one at first use, which would claim free memory the target's pool is counting on."""
        if self._runner is None:
            self.pool = pool

    def drafter(self) -> "NgramDrafter | ModelDrafter | None":
        if self.method == "ngram":
            return NgramDrafter(self.ngram_max, self.ngram_min)
        if self.method == "draft":
            if self._runner is None:
                pool = self.pool if self.pool is not None else pool_for(self.draft, self.draft_memory)
                self._runner = ModelRunner(self.draft, pool, self.compiled)
            return ModelDrafter(self._runner)
        return None


def refuse_recurrent_draft(draft: Any) -> None:
    """A draft model drafts in decode bursts over its own cache, which recurrent states do not
    support: a draft with linear-attention layers is refused in one line (as a target it works)."""
    if getattr(draft, "recurrent", False):
        raise UserError(
            "decode.draft_model has linear-attention layers (recurrent states, e.g. Qwen3.5): a draft "
            "model must be an attention-only model; use decode.speculative=ngram or another draft"
        )


def check_settings(method: str, num_draft: Any, ngram_max: Any, ngram_min: Any, *, has_draft: bool) -> None:
    """The rules of ``decode.speculative`` and its companions; one line naming the setting."""
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
        raise UserError(
            f"{name} has another tokenizer than the target model ({len(dv)} vs {len(tv)} tokens; "
            f"first differences: {differ}): the draft must share the target's tokenizer"
        )


def draft_budget(num_draft: int, generated: int, max_new_tokens: int, budget: int) -> int:
    """Drafts this round: never past ``max_new_tokens`` (the round also yields one token of the
    target's own) nor past the step's token budget (the chunk is the drafts plus one)."""
    return max(0, min(num_draft, max_new_tokens - generated - 1, budget - 1))


def propose(seq: Any, budget: int) -> None:
    """Ask a speculating sequence's drafter for this decode step's drafts (into ``seq.spec``),
    as many as ``draft_budget`` allows; the time it took is the sequence's ``draft`` span."""
    spec, ctx = seq.spec, seq.ctx
    k = draft_budget(spec.per_round, len(ctx.generated), ctx.request.max_new_tokens, budget)
    t0 = time.perf_counter()
    if k >= 1:
        spec.drafts, spec.q = spec.drafter.propose(seq.ids, k, seq.sampler)
    ctx.metrics.add_span("draft", time.perf_counter() - t0 if k >= 1 else 0.0, 1)
    ctx.metrics.count("spec_drafted", 0)  # counted when verified (a preempted step's drafts are not)
