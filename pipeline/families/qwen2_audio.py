"""Qwen2-Audio: Whisper-style log-mel features -> audio tower -> projector, at <|AUDIO|> slots.

What is special about this family, so that stages stay generic:
- audio must be at the feature extractor's sampling rate (16 kHz) and at most its window long
  (``n_samples / sampling_rate`` = 30 s): longer clips would be silently truncated by the
  feature extractor, so they are split into chunks (one audio item each) or refused;
- the processor pads every clip to the full window and returns ``feature_attention_mask``;
  the number of audio tokens per clip follows from that mask (two stride-2 reductions);
- transformers 5.x has no ``get_audio_features`` for it: :meth:`encode_audio` mirrors what
  ``Qwen2AudioModel.forward`` does (bidirectional mask, tower, projector, valid frames);
- positions are plain 1-D (the base Family's explicit ``position_ids``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import TYPE_CHECKING, Any, Hashable, Sequence

import numpy as np
import torch
from transformers.masking_utils import create_bidirectional_mask

from pipeline.errors import UserError
from pipeline.families.base import Family, media_keys, placeholder_spans
from pipeline.media import content_hash, load_audio
from pipeline.media.audio import resample, split_audio

if TYPE_CHECKING:
    from pipeline.context import Context, Request

LONG_AUDIO_POLICIES = ("split", "error")


class Qwen2AudioFamily(Family):
    """Qwen2-Audio(-Instruct): one ``<|AUDIO|>`` run per clip, expanded by the processor."""

    name = "qwen2-audio"
    model_types = ("qwen2_audio",)
    auto_class = "Qwen2AudioForConditionalGeneration"
    uses_processor = True
    media = ("audio",)
    encoder_modules = ("audio_tower", "multi_modal_projector")

    # --- prompt ---------------------------------------------------------------------------
    def content(self, text: str, images: int, audios: int, kinds: Sequence[str] | None = None) -> Any:
        """Audio items carry an ``audio`` key: the published template tests for the key, not the type.
        (Audio is its only medium, so ``kinds`` has no order to add.)"""
        items: list[dict] = [{"type": "audio", "audio": f"audio {i + 1}"} for i in range(audios)]
        items.append({"type": "text", "text": text})
        return items

    # --- what the feature extractor wants -------------------------------------------------
    @staticmethod
    def sampling_rate(lm: Any) -> int:
        """The rate every waveform must have when it reaches the feature extractor."""
        return int(lm.processor.feature_extractor.sampling_rate)

    @staticmethod
    def window_seconds(lm: Any) -> float:
        """The encoder's input window; the feature extractor truncates anything longer."""
        fe = lm.processor.feature_extractor
        return float(fe.n_samples) / float(fe.sampling_rate)

    @staticmethod
    def audio_token_id(lm: Any) -> int:
        return int(lm.config.audio_token_id)

    # --- request -> waveforms at the model's rate, split to the window -------------------------
    def prepare(self, lm: Any, request: "Request", long_audio: str = "split") -> "Request":
        """A copy of ``request`` whose audios are ``(1-D float32 wave, model rate)`` pairs, each
        within the encoder window. Paths are loaded, other rates resampled, long clips split into
        equal chunks (each its own audio item, in order) or refused, per ``long_audio``."""
        if not request.audios:
            return request
        if long_audio not in LONG_AUDIO_POLICIES:
            raise UserError(f"media.long_audio must be one of {', '.join(LONG_AUDIO_POLICIES)} (got {long_audio!r})")
        rate = self.sampling_rate(lm)
        window_s = self.window_seconds(lm)
        window = int(round(window_s * rate))
        audios: list[tuple[torch.Tensor, int]] = []
        chunks_per_item: list[int] = []
        for i, item in enumerate(request.audios):
            wave, label = waveform(item, rate, i)
            parts = [wave]
            if wave.numel() > window:
                seconds = wave.numel() / rate
                k = math.ceil(wave.numel() / window)
                if long_audio == "error":
                    raise UserError(
                        f"{label}: {seconds:.1f} s of audio is longer than the encoder's {window_s:g} s window "
                        f"(set media.long_audio=split to feed it as {k} chunks)"
                    )
                parts = split_audio(wave, rate, window_s)
            audios += [(p, rate) for p in parts]
            chunks_per_item.append(len(parts))
        messages, order = request.messages, request.media_order
        if any(n > 1 for n in chunks_per_item):
            messages = _expand_audio_items(messages, chunks_per_item) if messages else messages
            order = _expand_audio_order(order, chunks_per_item) if order is not None else order
        return dataclasses.replace(request, audios=audios, messages=messages, media_order=order)

    def process(self, lm: Any, text: str, request: "Request") -> dict:
        """Log-mel features for the (prepared) audios, and the prompt with each placeholder expanded."""
        processor = lm.processor
        placeholder = processor.audio_token
        found = text.count(placeholder)
        if found != len(request.audios):
            raise UserError(
                f"the prompt has {found} audio placeholder(s) {placeholder} but {len(request.audios)} audio clip(s) "
                "were given (each audio item in the messages needs one clip, in order)"
            )
        if not request.audios:
            return processor(text=[text], return_tensors="pt")
        rate = self.sampling_rate(lm)
        waves = [np.asarray(w.detach().cpu().numpy(), dtype=np.float32) for w, _ in request.audios]
        inputs = processor(text=[text], audio=waves, sampling_rate=rate, return_tensors="pt")
        counts = self.audio_token_counts(lm, inputs["feature_attention_mask"])
        for j, (n, (w, r)) in enumerate(zip(counts, request.audios)):
            if n < 1:
                raise UserError(
                    f"audio clip {j + 1} is too short ({w.numel() / r * 1000:.1f} ms) to give the encoder one frame"
                )
        return inputs

    @staticmethod
    def audio_token_counts(lm: Any, feature_attention_mask: torch.Tensor) -> list[int]:
        """Audio tokens per clip: the valid mel frames after the conv stride and the pooler."""
        tower = lm.model.model.audio_tower
        _, out = tower._get_feat_extract_output_lengths(feature_attention_mask.sum(-1))
        return [int(n) for n in out.tolist()]

    def audio_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        """[start, end) of each clip's ``<|AUDIO|>`` run in the prompt, in clip order."""
        if not ctx.request.audios:
            return []
        counts = self.audio_token_counts(ctx.lm, ctx.model_inputs["feature_attention_mask"])
        return placeholder_spans(ctx.input_ids[0], self.audio_token_id(ctx.lm), counts, "audio")

    def token_keys(self, ctx: "Context") -> list[Hashable]:
        """Token ids, except ``(id, content_hash, index)`` at audio slots: different clips never match."""
        hashes = [content_hash((w, r)) for w, r in ctx.request.audios]
        return media_keys(ctx.input_ids[0].tolist(), self.audio_spans(ctx), hashes)

    # --- the encoder ----------------------------------------------------------------------
    def encode_audio(
        self,
        lm: Any,
        input_features: torch.Tensor,
        feature_attention_mask: torch.Tensor,
        batch_size: int | None = None,
    ) -> torch.Tensor:
        """``[sum of audio tokens, hidden]`` embeddings in prompt order, as ``Qwen2AudioModel.forward``
        computes them before merging: the tower sees a bidirectional mask over the valid frames."""
        inner = lm.model.model
        tower, projector = inner.audio_tower, inner.multi_modal_projector
        device = tower.device
        embed_dtype = inner.get_input_embeddings().weight.dtype
        step = batch_size or input_features.shape[0]
        out: list[torch.Tensor] = []
        for begin in range(0, input_features.shape[0], step):
            feats = input_features[begin : begin + step].to(device)
            fmask = feature_attention_mask[begin : begin + step].to(device)
            feat_lengths, out_lengths = tower._get_feat_extract_output_lengths(fmask.sum(-1))
            batch, _, mel_len = feats.shape
            max_len = (mel_len - 2) // 2 + 1  # frames after conv2 (stride 2)
            frames = torch.arange(max_len, dtype=feat_lengths.dtype, device=device).unsqueeze(0)
            mask_2d = (frames < feat_lengths.unsqueeze(1)).to(torch.long)
            mask = create_bidirectional_mask(
                config=tower.config,
                inputs_embeds=torch.zeros((batch, max_len, 1), dtype=embed_dtype, device=device),
                attention_mask=mask_2d,
            )
            hidden = projector(tower(feats, attention_mask=mask).last_hidden_state)
            valid = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0) < out_lengths.to(
                hidden.device
            ).unsqueeze(1)
            out.append(hidden[valid])
        return torch.cat(out, dim=0)


def waveform(item: Any, rate: int, i: int) -> tuple[torch.Tensor, str]:
    """One audio input (path or ``(wave, rate)``) as a 1-D float32 CPU tensor at ``rate``, and its label."""
    if isinstance(item, (str, os.PathLike)):
        wave, _ = load_audio(item, rate)
        return wave, str(item)
    label = f"audio input {i + 1}"
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise UserError(f"{label}: expected a file path or a (waveform, sample_rate) pair, got {type(item).__name__}")
    wave, source_rate = item
    if (
        isinstance(source_rate, bool)
        or not isinstance(source_rate, numbers.Real)
        or source_rate <= 0
        or int(source_rate) != source_rate
    ):
        raise UserError(f"{label}: sample rate must be a positive integer (got {source_rate!r})")
    source_rate = int(source_rate)
    if isinstance(wave, np.ndarray):
        if not np.issubdtype(wave.dtype, np.floating):
            raise UserError(f"{label}: unsupported sample format {wave.dtype}: give float samples in [-1, 1]")
        wave = torch.from_numpy(np.ascontiguousarray(wave))
    elif not isinstance(wave, torch.Tensor):
        raise UserError(f"{label}: waveform must be a numpy array or a torch tensor (got {type(wave).__name__})")
    if not wave.is_floating_point():
        raise UserError(f"{label}: unsupported sample format {wave.dtype}: give float samples in [-1, 1]")
    if wave.dim() != 1:
        raise UserError(f"{label}: waveform must be 1-D mono samples (got shape {tuple(wave.shape)})")
    if wave.numel() == 0:
        raise UserError(f"{label}: audio contains no samples")
    wave = wave.detach().to("cpu", torch.float32).contiguous()
    if not bool(torch.isfinite(wave).all()):
        raise UserError(f"{label}: audio contains NaN or infinite samples")
    return resample(wave, source_rate, rate), label


def _expand_audio_order(order: list[str], chunks_per_item: list[int]) -> list[str]:
    """``Request.media_order`` with each audio entry repeated once per chunk its clip was split into."""
    chunks = iter(chunks_per_item)
    return [kind for entry in order for kind in ([entry] * next(chunks) if entry == "audio" else [entry])]


def _expand_audio_items(messages: list[dict], chunks_per_item: list[int]) -> list[dict]:
    """Repeat each audio content item once per chunk its clip was split into (clips in order)."""
    out: list[dict] = []
    item = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        new_content: list = []
        for part in content:
            is_audio = isinstance(part, dict) and (
                part.get("type") == "audio" or "audio" in part or "audio_url" in part
            )
            if is_audio and item < len(chunks_per_item):
                new_content += [dict(part) for _ in range(chunks_per_item[item])]
                item += 1
            else:
                new_content.append(part)
        out.append({**message, "content": new_content})
    return out
