"""AudioEncoder: waveforms -> log-mel features (made in Tokenize) -> audio embeddings at the placeholders."""
from __future__ import annotations

import torch

from pipeline.context import Context
from pipeline.families.base import scatter_media


class AudioEncoder:
    """Encodes the prompt's audio clips and writes their embeddings into ``ctx.inputs_embeds``.

    The model knowledge (feature masks, the tower and projector, the placeholder id) lives in
    the family (``encode_audio``, ``audio_token_id``); this stage decides when to encode and
    counts. When the KV cache already holds every audio position of the prompt (a follow-up
    turn about the same clip), the encoder is not run: Prefill never reads those positions.
    ``batch_size`` bounds how many 30 s windows go through the tower at once (None = all).

    Counters: ``audio_seconds`` (audio fed to the encoder, so ``audio_rtf`` = encoder seconds /
    audio seconds) and ``audio_tokens`` (audio placeholder positions in the prompt).
    """

    def __init__(self, batch_size: int | None = None) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"audio_encoder.batch_size must be >= 1 (got {batch_size})")
        self.batch_size = batch_size

    def skip(self, ctx: Context) -> bool:
        return not ctx.request.audios

    def __call__(self, ctx: Context) -> Context:
        lm, family, m = ctx.lm, ctx.lm.family, ctx.metrics
        token = family.audio_token_id(lm)
        slots = (ctx.input_ids[0] == token).nonzero().flatten()
        m.count("audio_tokens", int(slots.numel()))
        total = ctx.input_ids.shape[1]
        # What Prefill will keep of the cache (it always recomputes at least the last token).
        kept = min(ctx.cache.common_prefix(ctx.token_keys), total - 1)
        if slots.numel() == 0 or kept > int(slots[-1]):
            m.count("audio_seconds", 0.0)
            if ctx.inputs_embeds is None:
                ctx.inputs_embeds = lm.model.get_input_embeddings()(ctx.input_ids)
            return ctx
        embeds = family.encode_audio(
            lm,
            ctx.model_inputs["input_features"],
            ctx.model_inputs["feature_attention_mask"],
            batch_size=self.batch_size,
        )
        scatter_media(ctx, token, embeds)
        m.count("audio_seconds", float(sum(_seconds(wave, rate) for wave, rate in ctx.request.audios)))
        return ctx


def _seconds(wave: torch.Tensor, rate: int) -> float:
    return wave.shape[-1] / float(rate)
