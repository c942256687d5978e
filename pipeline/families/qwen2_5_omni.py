"""Qwen2.5-Omni, the thinker (text out; the talker and its speech are not run): images, video and
audio in one prompt, in the order given, and a video's own audio track heard with it.

What is particular to it, so that the stages can stay generic:

- images and video are Qwen2.5-VL's (``<|IMAGE|>`` / ``<|VIDEO|>`` runs from the grids, the same
  vision tower calls), audio is a Whisper-style tower (``<|AUDIO|>`` runs) whose clips are cut to
  the feature extractor's window like Qwen2-Audio's;
- with ``media.use_audio_in_video`` (``Tokenize(use_audio_in_video=True)``) every video is heard:
  its sound track (``Video.audio``, decoded with the clip) is one more audio input, and the
  processor interleaves its ``<|AUDIO|>`` tokens with the video's in 2 s chunks between
  ``<|audio_bos|>`` and ``<|audio_eos|>``. Such a video's span covers the whole interleaved run and
  the vision stage fills it (tower rows at the video tokens, audio-tower rows at the audio ones),
  so the audio stage only sees the clips given on their own (and ``audio_seconds`` counts only
  those). The model's positions hear all videos or none, so a video without a track is refused;
- positions are 4 rows (text, then temporal/height/width) from the model's own ``get_rope_index``,
  which places video frames and audio on one time axis (25 positions a second). One frame rate
  per prompt is what the processor takes: the clips' sampled rate (their mean when they differ);
- the published checkpoint (``model_type`` qwen2_5_omni, weights under ``thinker.``) loads into
  the thinker class as it is; its ``rope_deltas`` live in the cache state as for Qwen2-VL.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import warnings
from typing import TYPE_CHECKING, Any, Hashable, Sequence

import numpy as np
import torch

from pipeline.errors import UserError
from pipeline.families.base import Family, media_keys, media_name, placeholder_spans
from pipeline.families.qwen2_audio import Qwen2AudioFamily
from pipeline.families.qwen2_vl import ROPE_DELTAS, Qwen2VLFamily, image_spans, load_images, load_videos
from pipeline.families.qwen2_vl import video_spans as vision_runs
from pipeline.media import Video, content_hash
from pipeline.media.audio import resample

if TYPE_CHECKING:
    from pipeline.context import Context, Request

IMAGE, VIDEO, AUDIO = "<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>"
HEARD = "use_audio_in_video"  # model_inputs key: the videos' tracks are interleaved with them
TRACKS = ("video_audio_features", "video_audio_mask")  # model_inputs keys: each video's track, in video order


class Qwen25OmniFamily(Qwen2VLFamily, Qwen2AudioFamily):
    """Qwen2.5-Omni thinker: Qwen2.5-VL's images and video, Whisper-style audio, one time axis."""

    name = "qwen2.5-omni"
    model_types = ("qwen2_5_omni_thinker", "qwen2_5_omni")
    auto_class = "Qwen2_5OmniThinkerForConditionalGeneration"
    media = ("image", "video", "audio")
    encoder_modules = ("visual", "audio_tower")
    audio_in_video = True  # can hear a video's own track (media.use_audio_in_video)

    # --- tokenize ---------------------------------------------------------------------------
    def content(self, text: str, images: int, audios: int, kinds: Sequence[str] | None = None) -> Any:
        """Media parts in the order given, then the text (the template reads each part's type)."""
        return Family.content(self, text, images, audios, kinds)

    def prepare(
        self, lm: Any, request: "Request", long_audio: str = "split", use_audio_in_video: bool = False
    ) -> "Request":
        """Videos decoded once, audio at the model's rate within its window (split as Qwen2-Audio
        does), and each video's track kept at that rate when it is heard, dropped otherwise."""
        request = Qwen2VLFamily.prepare(self, lm, request)
        request = Qwen2AudioFamily.prepare(self, lm, request, long_audio=long_audio)
        videos = [
            self._track(lm, v, i) if use_audio_in_video else dataclasses.replace(v, audio=None)
            for i, v in enumerate(request.videos)
        ]
        return dataclasses.replace(request, videos=videos) if videos else request

    def _track(self, lm: Any, video: Video, index: int) -> Video:
        """``video`` with its sound track at the model's rate; refused when it has none or it is
        longer than the encoder's window (a track cannot be split: it is one with its frames)."""
        name = media_name(video, "video", index)
        if video.audio is None:
            raise UserError(
                f"{name}: the clip has no audio track: media.use_audio_in_video=true hears every "
                "video of the prompt (set it false to watch without listening)"
            )
        wave, rate = video.audio
        target = self.sampling_rate(lm)
        wave = resample(wave, rate, target)
        if wave.numel() > int(round(self.window_seconds(lm) * target)):
            raise UserError(
                f"{name}: its audio track is {wave.numel() / target:.1f} s, longer than the audio "
                f"encoder's {self.window_seconds(lm):g} s window (media.use_audio_in_video=false "
                "watches it without listening)"
            )
        if wave.numel() < 400:  # one feature frame (25 ms)
            raise UserError(f"{name}: its audio track is too short to hear")
        return dataclasses.replace(video, audio=(wave, target))

    def process(self, lm: Any, text: str, request: "Request") -> dict:
        """Processor outputs for the rendered prompt and its media; a heard video's track goes in
        as the audio of that video, and its features are then kept apart (``TRACKS``) from those
        of the clips given on their own, which the audio stage encodes."""
        images = load_images(list(request.images))
        videos = load_videos(list(request.videos))
        audios = list(request.audios)
        for kind, pad, items in (("image", IMAGE, images), ("video", VIDEO, videos), ("audio", AUDIO, audios)):
            found = text.count(pad)
            if found != len(items):
                raise UserError(f"the prompt has {found} {kind} placeholder(s) but {len(items)} {kind}(s) were given")
        heard = bool(videos) and videos[0].audio is not None
        if any((v.audio is not None) != heard for v in videos):
            raise UserError("some videos carry their audio track and others not: the model hears all or none")
        slots = _audio_slots(text) if heard else [None] * len(audios)  # each audio input: None or its video
        rate = self.sampling_rate(lm)
        waves = iter(audios)
        clips = [
            np.asarray((next(waves) if k is None else videos[k].audio)[0].cpu().numpy(), dtype=np.float32)
            for k in slots
        ]
        kwargs: dict[str, Any] = {"images": images or None}
        if videos:
            kwargs.update(videos=[v.frames for v in videos], fps=_frame_rate(videos), **self.video_kwargs(lm))
        if clips:
            kwargs.update(audio=clips, sampling_rate=rate)
        if heard:
            kwargs.update(load_audio_from_video=True, audio_from_video_indices=slots)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Passing `min_pixels` and `max_pixels`", FutureWarning)
                out = dict(lm.processor(text=[text], return_tensors="pt", **kwargs))
        except ValueError as err:  # e.g. an aspect ratio beyond 200:1, which smart_resize refuses
            raise UserError(f"the processor refused the prompt's media: {' '.join(str(err).split())}") from None
        if clips:
            self._check_lengths(lm, out["feature_attention_mask"], slots, videos)
            out["audio_feature_lengths"] = out["feature_attention_mask"].sum(-1)  # every input, prompt order
        if heard:
            _keep_tracks_apart(out, slots)
        out["image_hashes"] = [content_hash(im) for im in images]
        if videos:
            out["video_hashes"] = [_video_hash(v) for v in videos]
        return out

    def _check_lengths(self, lm: Any, mask: torch.Tensor, slots: list, videos: list) -> None:
        """Every audio input gives the encoder at least one frame."""
        for j, n in enumerate(self.audio_token_counts(lm, mask)):
            if n < 1:
                k = slots[j]
                name = (
                    f"audio clip {sum(s is None for s in slots[:j]) + 1}"
                    if k is None
                    else f"{media_name(videos[k], 'video', k)}'s audio track"
                )
                raise UserError(f"{name} is too short to give the encoder one frame")

    def token_keys(self, ctx: "Context") -> list[Hashable]:
        """Token ids, except ``(id, content hash, index)`` over each image, video (with its track
        when heard) and audio clip."""
        spans = image_spans(ctx) + self.video_spans(ctx) + self.audio_spans(ctx)
        hashes = (
            list(ctx.model_inputs.get("image_hashes") or [])
            + list(ctx.model_inputs.get("video_hashes") or [])
            + [content_hash((w, r)) for w, r in ctx.request.audios]
        )
        return media_keys(ctx.input_ids[0].tolist(), spans, hashes)

    # --- positions --------------------------------------------------------------------------
    def prompt_positions(self, ctx: "Context", start: int) -> torch.Tensor:
        """[4, 1, L - start]: the text position, then ``get_rope_index``'s time-aligned rows (plain
        positions when the prompt has no image or video); stores rope_deltas in the cache state."""
        ids, inputs = ctx.input_ids, ctx.model_inputs
        length = ids.shape[1]
        text_pos = torch.arange(length, device=ids.device).view(1, 1, -1)
        grids = {key: inputs.get(key) for key in ("image_grid_thw", "video_grid_thw")}
        if any(grid is not None for grid in grids.values()):
            seconds = inputs.get("video_second_per_grid")
            rope, deltas = ctx.lm.model.get_rope_index(
                ids,
                **{key: grid.to(ids.device) for key, grid in grids.items() if grid is not None},
                attention_mask=torch.ones_like(ids),
                use_audio_in_video=bool(inputs.get(HEARD, False)),
                audio_seqlens=inputs.get("audio_feature_lengths"),
                second_per_grids=None if seconds is None else torch.as_tensor(seconds),
            )
            rope, delta = rope.to(ids.device), int(deltas.view(-1)[0])
        else:
            rope, delta = text_pos.expand(3, 1, length), 0
        ctx.cache.state[ROPE_DELTAS] = delta
        return torch.cat([text_pos, rope], dim=0)[..., start:]

    # --- what the vision stage asks ----------------------------------------------------------
    def video_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        """[start, end) of each video's placeholders, in video order; a heard video's span is its
        whole interleaved run, from its first video token to its ``<|audio_eos|>``."""
        if not ctx.model_inputs.get(HEARD):
            return vision_runs(ctx)
        ids = ctx.input_ids[0].tolist()
        config = ctx.lm.config
        ends = [p for p, i in enumerate(ids) if i == config.audio_end_token_id]
        spans = []
        for p in range(1, len(ids)):
            if ids[p] == config.audio_start_token_id and ids[p - 1] == config.vision_start_token_id:
                spans.append((p + 1, next(e for e in ends if e > p)))
        if len(spans) != ctx.model_inputs["video_grid_thw"].shape[0]:
            raise UserError(
                f"the prompt has {len(spans)} heard video placeholder(s) but "
                f"{ctx.model_inputs['video_grid_thw'].shape[0]} video(s) were given"
            )
        return spans

    def encode_videos(self, ctx: "Context", items: list[int]) -> tuple[torch.Tensor, float]:
        """Qwen2-VL's video embeddings; for heard videos, rows for each whole span: the tower's at
        its video tokens, the audio tower's (its track) at its audio tokens."""
        if not ctx.model_inputs.get(HEARD):
            return Qwen2VLFamily.encode_videos(self, ctx, items)
        frames, megapixels = Qwen2VLFamily.encode_videos(self, ctx, items)
        sound = self.encode_audio(ctx.lm, ctx.model_inputs[TRACKS[0]][items], ctx.model_inputs[TRACKS[1]][items])
        spans, ids = self.video_spans(ctx), ctx.input_ids[0]
        video_id, audio_id = self.video_token_id(ctx), self.audio_token_id(ctx.lm)
        rows, used = [], {"video": 0, "audio": 0}
        for k in items:
            start, end = spans[k]
            span = ctx.inputs_embeds[0, start:end].clone()
            for kind, token, source in (("video", video_id, frames), ("audio", audio_id, sound)):
                where = ids[start:end] == token
                count = int(where.sum())
                span[where.to(span.device)] = source[used[kind] : used[kind] + count].to(span.device, span.dtype)
                used[kind] += count
            rows.append(span)
        return torch.cat(rows, dim=0), megapixels

    # --- what the audio stage asks -----------------------------------------------------------
    def audio_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        """[start, end) of each clip given on its own, in clip order (a heard video's audio tokens
        are part of that video's span)."""
        if not ctx.request.audios:
            return []
        ids = ctx.input_ids[0].clone()
        for start, end in self.video_spans(ctx) if ctx.model_inputs.get(HEARD) else []:
            ids[start:end] = -1
        counts = self.audio_token_counts(ctx.lm, ctx.model_inputs["feature_attention_mask"])
        return placeholder_spans(ids, self.audio_token_id(ctx.lm), counts, "audio")

    def encode_audio(
        self, lm: Any, input_features: torch.Tensor, feature_attention_mask: torch.Tensor, batch_size: int | None = None
    ) -> torch.Tensor:
        """``[sum of audio tokens, hidden]`` in clip order, through the model's own
        ``get_audio_features`` (valid frames only, in 2 s windows)."""
        model = lm.model.model
        device = next(model.audio_tower.parameters()).device
        step = batch_size or input_features.shape[0]
        out = [
            model.get_audio_features(
                input_features[b : b + step].to(device), feature_attention_mask[b : b + step].to(device)
            ).last_hidden_state
            for b in range(0, input_features.shape[0], step)
        ]
        return torch.cat(out, dim=0)


def _audio_slots(text: str) -> list[int | None]:
    """Each audio input of a prompt whose videos are heard, in prompt order: None for a clip
    given on its own, ``k`` for video ``k``'s track (what ``audio_from_video_indices`` says)."""
    slots: list[int | None] = []
    videos = 0
    for match in re.finditer(re.escape(AUDIO) + "|" + re.escape(VIDEO), text):
        if match.group() == VIDEO:
            slots.append(videos)
            videos += 1
        else:
            slots.append(None)
    return slots


def _keep_tracks_apart(out: dict, slots: list[int | None]) -> None:
    """Move the heard videos' rows of the audio features to ``TRACKS`` (in video order), leaving
    ``input_features`` / ``feature_attention_mask`` to the clips given on their own."""
    own = [j for j, k in enumerate(slots) if k is None]
    tracks = [j for _, j in sorted((k, j) for j, k in enumerate(slots) if k is not None)]
    for key, kept in zip(("input_features", "feature_attention_mask"), TRACKS):
        out[kept], out[key] = out[key][tracks], out[key][own]
    out[HEARD] = True


def _frame_rate(videos: Sequence[Video]) -> float:
    """The frame rate the processor times video positions by: the clips' sampled rate (one value
    per call, so their mean when clips were sampled at different rates)."""
    return float(sum(v.sampled_fps for v in videos) / len(videos))


def _video_hash(video: Video) -> str:
    """A video's cache identity: its frames and timing, and its track when heard."""
    if video.audio is None:
        return content_hash(video)
    return hashlib.sha256(f"{content_hash(video)}\0{content_hash(video.audio)}".encode()).hexdigest()
