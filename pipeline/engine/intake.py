"""From a request to the model's inputs: a sequence's front stages at admission, and the chunk
each step feeds (``make_chunk``)."""

from __future__ import annotations

from typing import Any, Mapping

from pipeline.engine import pooling
from pipeline.engine.output import Output
from pipeline.engine.scheduler import Scheduled
from pipeline.engine.sequence import Layout, Sequence
from pipeline.errors import UserError
from pipeline.memory import text_config
from pipeline.runner import Chunk, lora
from pipeline.sampling.logprobs import check_setting

MEDIA = {"images": "image", "videos": "video", "audios": "audio"}  # Request field -> the kind a stage encodes


def prepare(seq: Sequence) -> None:
    """Everything before the first forward: the front stages (tokenize, encoders; media whose
    positions the prefix cache holds are skipped), limits checked, prefix reuse, positions."""
    ctx = seq.ctx
    if seq.phases.front:
        check_media(seq.phases.front, ctx.request)
    if ctx.request.pooling is not None:
        pooling.check(ctx.request)
    adapter = seq.adapter
    ctx.cache.key_by(None if adapter is None else adapter.root)  # no KV shared across adapters
    plan = None if adapter is None else lora.plan_for(ctx.lm, [adapter], [1], ctx.lm.device)
    with lora.applied(plan):  # the encoders run under the adapter too (LoRA on a vision tower)
        reused = _run_front(seq)
    if ctx.input_ids is None or ctx.input_ids.shape[1] == 0:
        raise UserError("the prompt has no tokens: there is nothing to prefill")
    total = seq.prompt_len = int(ctx.input_ids.shape[1])
    _check_limits(seq, total)
    bs = ctx.cache.block_size
    # Recurrent layers: keep the state where the next chat turn comes back to (the prompt's end,
    # its reply header) and at the last block boundary a repeat of this prompt can reuse.
    ctx.cache.checkpoint_at(total, (total - 1) // bs * bs, *([ctx.reply_start] if ctx.reply_start else []))
    if seq.pending is None:  # not prefilled yet: keep what the cache (and the prefix cache) holds
        start = reused if reused is not None else ctx.cache.reuse(seq.reusable(ctx.token_keys))
        ctx.metrics.set("prompt_tokens", total)
        ctx.metrics.set("kv_reused_tokens", start)
        ctx.metrics.set("prefill_tokens", 0)
    elif ctx.cache.length != total or ctx.cache.keys != list(ctx.token_keys):
        raise ValueError("DecodeLoop needs the context Prefill just ran on (the cache must hold exactly the prompt)")
    family = ctx.lm.family
    pos = family.prompt_positions(ctx, 0)
    seq.ids = ctx.input_ids[0].tolist() + list(ctx.generated)
    seq.keys = list(ctx.token_keys) + list(ctx.generated)
    if seq.grammar is not None:
        seq.grammar.start(seq.ids[:total])
    if not seq.prefill_only:
        req = ctx.request
        eos = frozenset() if req.ignore_eos else frozenset(ctx.lm.eos_token_ids)
        stop_ids = frozenset(int(t) for t in req.stop_token_ids)
        seq.output = Output(
            ctx.lm.tokenizer, req.max_new_tokens, req.stop, eos, ctx.on_text, stop_ids, req.min_new_tokens
        )
    ctx.finish_reason = None
    seq.layout = Layout(
        pos.reshape(-1, pos.shape[-1]).tolist(),
        family.decode_positions(ctx, 0).reshape(-1).tolist(),
        [(int(a), int(b)) for a, b in family.bidirectional_spans(ctx)],
    )


def check_media(stages: Mapping[str, Any], request: Any) -> None:
    """Refuse a request with media no stage encodes (e.g. ``stages.vision_encoder=null`` and an
    image): its placeholders would reach the model unfilled. Stages say what they encode
    (``media_kinds``)."""
    encoded = {kind for stage in stages.values() for kind in getattr(stage, "media_kinds", ())}
    for name, kind in MEDIA.items():
        if getattr(request, name) and kind not in encoded:
            raise UserError(
                f"the request has {name} but no stage encodes a {kind} (is stages.vision_encoder or "
                f"stages.audio_encoder null?)"
            )


def _run_front(seq: Sequence) -> int | None:
    """The per-request stages; the prefix cache is consulted as soon as the prompt's cache keys
    are known, so encoders skip media already cached. Returns the tokens reused (None: not yet)."""
    ctx, reused = seq.ctx, None
    for name, stage in seq.phases.front.items():
        if ctx.token_keys is not None and reused is None:
            reused = ctx.cache.reuse(seq.reusable(ctx.token_keys))
        skip = getattr(stage, "skip", None)
        if skip is not None and skip(ctx):
            continue
        with ctx.metrics.span(name):
            stage(ctx)
    return reused


def _check_limits(seq: Sequence, total: int) -> None:
    ctx, req = seq.ctx, seq.ctx.request
    if not seq.prefill_only and req.max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1 (got {req.max_new_tokens})")
    _check_logprobs(seq)
    _check_logit_bias(seq)
    _check_ends(seq)
    context = getattr(text_config(ctx.lm.config), "max_position_embeddings", None)
    if not seq.prefill_only and context and total + req.max_new_tokens > context:
        raise UserError(
            f"the prompt ({total} tokens) plus max_new_tokens ({req.max_new_tokens}) exceed the "
            f"model's context of {context} tokens"
        )
    if req.pooling is not None and context and total > context:
        raise UserError(f"the prompt ({total} tokens) exceeds the model's context of {context} tokens")
    ctx.cache.ensure_capacity(total + (0 if seq.prefill_only else req.max_new_tokens - 1))


def _check_ends(seq: Sequence) -> None:
    """``stop_token_ids`` the model has; ``min_new_tokens`` a whole number up to ``max_new_tokens``."""
    req = seq.ctx.request
    vocab = int(text_config(seq.ctx.lm.config).vocab_size)
    bad = [t for t in req.stop_token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise UserError(f"stop_token_ids {bad[:5]} are not token ids of this model's vocabulary of {vocab} tokens")
    low = req.min_new_tokens
    if (
        isinstance(low, bool)
        or not isinstance(low, int)
        or low < 0
        or (not seq.prefill_only and low > req.max_new_tokens)
    ):
        raise UserError(f"min_new_tokens must be a whole number from 0 to max_new_tokens (got {low!r})")


def _check_logit_bias(seq: Sequence) -> None:
    """A bias on a token the model does not have fails this request alone, before its first step."""
    bias = getattr(seq.sampler, "logit_bias", None)
    vocab = int(text_config(seq.ctx.lm.config).vocab_size)
    unknown = sorted(t for t in bias or () if t >= vocab)
    if unknown:
        raise UserError(f"logit_bias names token ids {unknown[:5]} outside the model's vocabulary of {vocab} tokens")


def _check_logprobs(seq: Sequence) -> None:
    req = seq.ctx.request
    for name in ("logprobs", "prompt_logprobs"):
        check_setting(name, getattr(req, name))
    if req.prompt_logprobs is not None and seq.pending is not None:
        raise UserError("prompt_logprobs needs the engine to run the prefill (this prompt was prefilled by hand)")
    start = req.prompt_logprobs_from
    if isinstance(start, bool) or not isinstance(start, int) or not 1 <= start < max(2, seq.prompt_len):
        raise UserError(
            f"prompt_logprobs_from must be a prompt position from 1 to {max(1, seq.prompt_len - 1)} (got {start!r})"
        )
    if req.logprobs is None:
        return
    check_setting("logprobs_mode", req.logprobs_mode)
    if seq.spec is not None:
        raise UserError(
            "logprobs with speculative decoding (decode.speculative) are not supported yet: "
            "leave decode.speculative unset for requests that ask for them"
        )


def make_chunk(item: Scheduled) -> Chunk:
    """The runner's view of a scheduled part: tokens [begin, end), then the step's drafts (whose
    logits are all kept, for verification)."""
    seq, begin, end = item.seq, item.begin, item.end
    layout, ctx = seq.layout, seq.ctx
    mid = min(end, seq.prompt_len)
    drafts = seq.drafts
    positions = [row[begin:mid] for row in layout.rows]
    if end + len(drafts) > mid:  # generated tokens (decode, or recompute after a preemption)
        after = range(max(begin, seq.prompt_len), end + len(drafts))
        positions = [row + [o + p for p in after] for row, o in zip(positions, layout.offsets)]
    embeds = ctx.inputs_embeds
    extras = ctx.lm.family.chunk_extras(ctx, begin, mid) if mid > begin else None
    spans = [(a, b) for a, b in layout.spans if a < mid and b > begin]
    if spans:  # read by the paged attention (runner.paged_batch._query_limits)
        extras = {**(extras or {}), "blocks": spans}
    return Chunk(
        table=list(seq.cache.blocks),
        start=begin,
        ids=seq.ids[begin:end] + drafts,
        positions=positions,
        slots=item.slots,
        embeds=embeds[0, begin:mid] if embeds is not None and mid > begin else None,
        state=seq.cache.state_io,
        logits=kept_rows(item),
        extras=extras,
        pool=None if ctx.request.pooling is None else pooling.chunk_pool(ctx.request, begin, end, seq.prompt_len),
        adapter=seq.adapter,
    )


def chosen_rows(item: Scheduled) -> int:
    """Logits rows that choose tokens: ``1 + drafts`` when the part ends at the known tokens."""
    return 1 + len(item.seq.drafts) if item.end == item.seq.known else 0


def scoring_positions(item: Scheduled) -> range:
    """Fed positions whose logits row scores the prompt token after it (``Request.prompt_logprobs``
    from ``prompt_logprobs_from``): empty when the part scores none."""
    seq = item.seq
    if not seq.scores_prompt:
        return range(0)
    first = max(item.begin, seq.scored_from - 1)
    return range(first, max(first, min(item.end, seq.prompt_len - 1)))


def prompt_rows(item: Scheduled) -> int:
    """Logits rows that score prompt tokens: the part's first kept rows."""
    return len(scoring_positions(item))


def kept_rows(item: Scheduled) -> int:
    """The part's last logits rows its forward keeps: every fed position from the first scoring
    one when some score the prompt (row r is that position + r), else the choosing rows."""
    scoring = scoring_positions(item)
    return item.end - scoring.start + len(item.seq.drafts) if scoring else chosen_rows(item)
