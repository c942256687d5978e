"""AudioEncoder: waveforms -> log-mel features (made in Tokenize) -> audio embeddings at the placeholders."""
from __future__ import annotations

import torch

from pipeline.context import Context
from pipeline.families.base import scatter_media


class AudioEncoder:
    """Encodes the prompt's audio clips and writes their embeddings into ``ctx.inputs_embeds``.

    The model knowledge (feature masks, the tower and projector, the placeholder id) lives in
    the family (``encode_audio``, ``audio_token_id``, ``audio_token_counts``); this stage decides
    what to encode and counts. A clip whose audio positions the KV cache already holds (a
    follow-up turn in a conversation) is not encoded again: Prefill never reads those positions.
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
        features = ctx.model_inputs["input_features"]
        feature_mask = ctx.model_inputs["feature_attention_mask"]
        slots = (ctx.input_ids[0] == token).nonzero().flatten().tolist()
        counts = family.audio_token_counts(lm, feature_mask)  # placeholders per clip, in prompt order
        m.count("audio_tokens", len(slots))
        # What Prefill will keep of the cache (it always recomputes at least the last token):
        # clips whose every slot lies before that are not encoded again.
        kept = min(ctx.cache.common_prefix(ctx.token_keys), ctx.input_ids.shape[1] - 1)
        ends = torch.tensor(counts).cumsum(0).tolist()
        todo = [j for j, end in enumerate(ends) if end > 0 and slots[end - 1] >= kept]
        seconds = sum(_seconds(*ctx.request.audios[j]) for j in todo)
        m.count("audio_seconds", float(seconds))
        if not todo:
            if ctx.inputs_embeds is None:
                ctx.inputs_embeds = lm.model.get_input_embeddings()(ctx.input_ids)
            return ctx
        embeds = family.encode_audio(lm, features[todo], feature_mask[todo], batch_size=self.batch_size)
        if len(todo) < len(counts):  # cached clips' slots get zeros: Prefill never reads them
            full = embeds.new_zeros((len(slots), embeds.shape[-1]))
            rows = torch.cat([torch.arange(ends[j] - counts[j], ends[j]) for j in todo])
            full[rows.to(full.device)] = embeds
            embeds = full
        scatter_media(ctx, token, embeds)
        return ctx


def _seconds(wave: torch.Tensor, rate: int) -> float:
    return wave.shape[-1] / float(rate)
