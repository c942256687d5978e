"""AudioEncoder: waveforms -> log-mel features (made in Tokenize) -> audio embeddings at the placeholders."""

from __future__ import annotations

import torch

from pipeline.context import Context
from pipeline.errors import whole_number
from pipeline.families.base import merge_media, prompt_embeds, uncached_items


class AudioEncoder:
    """Encodes the prompt's audio clips and writes their embeddings into ``ctx.inputs_embeds``.

    The model knowledge (feature masks, the tower and projector, the placeholder id) lives in
    the family (``audio_spans``, ``encode_audio``); this stage decides what to encode and counts.
    A clip whose audio positions the KV cache already holds (a
    follow-up turn in a conversation) is not encoded again: Prefill never reads those positions.
    ``batch_size`` bounds how many 30 s windows go through the tower at once (None = all).

    Counters: ``audio_seconds`` (audio fed to the encoder, so ``audio_rtf`` = encoder seconds /
    audio seconds) and ``audio_tokens`` (audio placeholder positions in the prompt).
    """

    def __init__(self, batch_size: int | None = None) -> None:
        self.batch_size = (
            None if batch_size is None else whole_number("audio_encoder.batch_size", batch_size, error=ValueError)
        )

    media_kinds = ("audio",)  # what it encodes: a request with audio needs it (engine.intake.check_media)

    def skip(self, ctx: Context) -> bool:
        return not ctx.request.audios

    def __call__(self, ctx: Context) -> Context:
        lm, family, m = ctx.lm, ctx.lm.family, ctx.metrics
        spans = family.audio_spans(ctx)  # one placeholder run per clip, in prompt order
        m.count("audio_tokens", sum(end - start for start, end in spans))
        prompt_embeds(ctx)
        todo = uncached_items(ctx, spans)
        m.count("audio_seconds", float(sum(_seconds(*ctx.request.audios[j]) for j in todo)))
        if not todo:
            return ctx
        if hasattr(family, "encode_audios"):  # the generic family: each clip's own processor inputs, as for images
            embeds = family.encode_audios(ctx, todo)
        else:
            features = ctx.model_inputs["input_features"][todo]
            feature_mask = ctx.model_inputs["feature_attention_mask"][todo]
            embeds = family.encode_audio(lm, features, feature_mask, batch_size=self.batch_size)
        merge_media(ctx, spans, todo, embeds)
        return ctx


def _seconds(wave: torch.Tensor, rate: int) -> float:
    return wave.shape[-1] / float(rate)
