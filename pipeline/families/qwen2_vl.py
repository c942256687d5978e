"""Qwen2-VL and Qwen2.5-VL: dynamic-resolution images and video, content-hashed cache keys, 3-D (M-RoPE) positions.

What is particular to these models, so that the stages can stay generic:

- the processor resizes each image to a multiple of 28 px within ``[min_pixels, max_pixels]``
  and expands one ``<|image_pad|>`` per image into ``grid_t * grid_h * grid_w / merge**2`` tokens;
- a video is frames already sampled in time (``pipeline.media.load_video``: ``media.video_fps``,
  ``media.video_max_frames``); the family's video processor resizes them within its pixel bounds,
  pairs them (``temporal_patch_size``) and expands one ``<|video_pad|>`` the same way. It is told
  not to sample again (``do_sample_frames=False``) and gets each clip's metadata (source frame
  count, mean rate, sampled frame indices), from which Qwen2.5-VL's processor derives
  ``second_per_grid_ts``, the seconds between temporal positions. The per-frame pixel cap of the
  reference implementation (``cap_pixels_per_frame``) is switched on unless the processor's own
  config decides, as transformers is about to do by default;
- every image or video placeholder position gets the cache key ``(token_id, content_hash, index)``
  (a video's hash covers its sampled frames and their timing), so a cached item is never
  mistaken for another one that happens to have the same size;
- positions are 4 rows, the layout transformers 5.23's own ``generate`` feeds the model: row 0
  is the plain text position (the cache index, which the attention mask is built from) and rows
  1-3 are the temporal/height/width M-RoPE positions from ``model.model.get_rope_index``.
  After the prompt, M-RoPE positions run ``rope_deltas`` ahead of the text position; that delta
  is per request and lives in ``ctx.cache.state`` (never in the model, which would leak it
  between requests).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import TYPE_CHECKING, Any, Hashable

import torch
from PIL import Image

from pipeline.errors import UserError
from pipeline.families.base import Family, media_keys, media_name, placeholder_spans
from pipeline.media import Video, content_hash, load_image, load_video, to_rgb

if TYPE_CHECKING:
    from pipeline.context import Context, Request

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
ROPE_DELTAS = "rope_deltas"  # key in KVCache.state


def load_images(images: list[Any]) -> list[Image.Image]:
    """Paths (Python API users may pass them) become RGB images; PIL images pass through."""
    out: list[Image.Image] = []
    for i, image in enumerate(images):
        if isinstance(image, (str, os.PathLike)):
            out.append(load_image(image))
        elif isinstance(image, Image.Image):
            out.append(to_rgb(image))  # alpha on white, as the file loader does
        else:
            raise UserError(f"image {i + 1}: expected a file path or a PIL image, got {type(image).__name__}")
    return out


def load_videos(videos: list[Any]) -> list[Video]:
    """Paths (Python API users may pass them) become clips sampled with the default settings;
    ``Video`` objects (``load_video`` with settings of one's own) pass through."""
    out: list[Video] = []
    for i, video in enumerate(videos):
        if isinstance(video, (str, os.PathLike)):
            out.append(load_video(video))
        elif isinstance(video, Video):
            out.append(video)
        else:
            raise UserError(
                f"video {i + 1}: expected a file path or a pipeline.media.Video, got {type(video).__name__}"
            )
    return out


class Qwen2VLFamily(Family):
    """Qwen2-VL: images and video through the model's own vision tower; 3-D rotary positions."""

    name = "qwen2-vl"
    model_types = ("qwen2_vl",)
    auto_class = "Qwen2VLForConditionalGeneration"
    media = ("image", "video")
    encoder_modules = ("visual",)
    uses_processor = True
    position_rows = 4  # the text position, then M-RoPE's temporal, height and width rows

    # --- tokenize ---------------------------------------------------------------------------
    def prepare(self, lm: Any, request: "Request", long_audio: str = "split") -> "Request":
        """Video paths decoded and sampled once, here, so every later stage (and its counters:
        frames, seconds) reads the same ``Video`` objects."""
        if not request.videos or all(isinstance(v, Video) for v in request.videos):
            return request
        return dataclasses.replace(request, videos=load_videos(list(request.videos)))

    def video_kwargs(self, lm: Any) -> dict[str, Any]:
        """Video processor settings for clips sampled already: no second sampling, and the
        reference per-frame pixel cap unless the processor's config says otherwise."""
        kwargs: dict[str, Any] = {"do_sample_frames": False}
        if getattr(lm.processor.video_processor, "cap_pixels_per_frame", False) is None:
            kwargs["cap_pixels_per_frame"] = True
        return kwargs

    def process(self, lm: Any, text: str, request: Any) -> dict:
        """Processor outputs for the rendered prompt, its images and its videos (dynamic resolution).

        Also returns ``image_hashes`` and ``video_hashes`` (one content hash per item, in prompt
        order) for the cache keys, computed here once so that paths are decoded only once.
        """
        images = load_images(list(request.images))
        videos = load_videos(list(request.videos))
        for kind, pad, items in (("image", IMAGE_PAD, images), ("video", VIDEO_PAD, videos)):
            placeholders = text.count(pad)
            if placeholders != len(items):
                raise UserError(
                    f"the prompt has {placeholders} {kind} placeholder(s) but {len(items)} {kind}(s) were given"
                )
        media: dict[str, Any] = {"images": images or None}
        if videos:
            media.update(
                videos=[v.frames for v in videos],
                video_metadata=[v.metadata() for v in videos],
                **self.video_kwargs(lm),
            )
        try:
            with warnings.catch_warnings():
                # min_pixels/max_pixels given to from_pretrained (model.processor) are replayed by
                # transformers 5.23 on every call with a deprecation warning; they still apply.
                warnings.filterwarnings("ignore", "Passing `min_pixels` and `max_pixels`", FutureWarning)
                out = dict(lm.processor(text=[text], return_tensors="pt", **media))
        except ValueError as err:  # e.g. an aspect ratio beyond 200:1, which smart_resize refuses
            names = ", ".join(
                [
                    f"{media_name(src, 'image', i)} ({im.size[0]}x{im.size[1]})"
                    for i, (src, im) in enumerate(zip(request.images, images))
                ]
                + [
                    f"{media_name(src, 'video', i)} ({v.size[0]}x{v.size[1]})"
                    for i, (src, v) in enumerate(zip(request.videos, videos))
                ]
            )
            raise UserError(f"{names}: the processor refused it: {' '.join(str(err).split())}") from None
        out.pop("video_metadata", None)  # returned by some processors; the clips keep their own
        out["image_hashes"] = [content_hash(im) for im in images]
        if videos:  # only then: image-only callers that hand model_inputs to generate() pop image_hashes alone
            out["video_hashes"] = [content_hash(v) for v in videos]
        return out

    def token_keys(self, ctx: "Context") -> list[Hashable]:
        """Token ids, except image and video positions: ``(pad token id, content hash, index in that item)``."""
        spans = image_spans(ctx) + video_spans(ctx)
        hashes = list(ctx.model_inputs.get("image_hashes") or []) + list(ctx.model_inputs.get("video_hashes") or [])
        return media_keys(ctx.input_ids[0].tolist(), spans, hashes)

    # --- positions --------------------------------------------------------------------------
    def prompt_positions(self, ctx: "Context", start: int) -> torch.Tensor:
        """[4, 1, L - start] positions of prompt tokens [start:]; stores rope_deltas in the cache state."""
        ids = ctx.input_ids
        length = ids.shape[1]
        text_pos = torch.arange(length, device=ids.device).view(1, 1, -1)
        grids = {key: ctx.model_inputs.get(key) for key in ("image_grid_thw", "video_grid_thw")}
        if any(grid is not None for grid in grids.values()) and bool(self.mm_token_type_ids(ctx).any()):
            extra = {}
            seconds = ctx.model_inputs.get("second_per_grid_ts")  # Qwen2.5-VL: time between temporal positions
            if seconds is not None and grids["video_grid_thw"] is not None:
                extra["second_per_grid_ts"] = torch.as_tensor(seconds, device=ids.device)
            rope, deltas = ctx.lm.model.model.get_rope_index(
                ids,
                mm_token_type_ids=self.mm_token_type_ids(ctx),
                **{key: grid.to(ids.device) for key, grid in grids.items() if grid is not None},
                **extra,
            )
            rope = rope.to(ids.device)
            delta = int(deltas.view(-1)[0])
        else:
            rope, delta = text_pos.expand(3, 1, length), 0
        ctx.cache.state[ROPE_DELTAS] = delta
        return torch.cat([text_pos, rope], dim=0)[..., start:]

    def decode_positions(self, ctx: "Context", position: int) -> torch.Tensor:
        """[4, 1, 1]: the text position, then three copies of text position + rope_deltas."""
        delta = int(ctx.cache.state.get(ROPE_DELTAS, 0))
        pos = torch.tensor([position] + [position + delta] * 3, device=ctx.input_ids.device)
        return pos.view(4, 1, 1)

    # --- what the vision stage asks ----------------------------------------------------------
    def image_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        """[start, end) of each image's placeholder run, in image order."""
        return image_spans(ctx)

    def encode_images(self, ctx: "Context", items: list[int]) -> tuple[torch.Tensor, float]:
        """The embeddings of images ``items`` (prompt order, concatenated) through the model's
        own vision tower, and the megapixels it saw (after dynamic resizing)."""
        grid, pixel_values = select_items(ctx.model_inputs["image_grid_thw"], ctx.model_inputs["pixel_values"], items)
        visual = ctx.lm.model.model
        device = next(visual.visual.parameters()).device
        features = visual.get_image_features(pixel_values.to(device), grid.to(device)).pooler_output
        patch = int(ctx.lm.config.vision_config.patch_size)
        megapixels = float(grid[:, 1:].prod(-1).sum()) * patch * patch / 1e6
        return (features if isinstance(features, torch.Tensor) else torch.cat(features, dim=0)), megapixels

    def video_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        """[start, end) of each video's placeholder run, in video order."""
        return video_spans(ctx)

    def encode_videos(self, ctx: "Context", items: list[int]) -> tuple[torch.Tensor, float]:
        """The embeddings of videos ``items`` (prompt order, concatenated) through the vision
        tower, and the megapixels it saw: each sampled frame at its resized size (the copy of the
        last frame that pads an odd count to the temporal patch is not counted, as an image's
        second temporal copy is not)."""
        grid, pixel_values = select_items(
            ctx.model_inputs["video_grid_thw"], ctx.model_inputs["pixel_values_videos"], items
        )
        visual = ctx.lm.model.model
        device = next(visual.visual.parameters()).device
        features = visual.get_video_features(pixel_values.to(device), grid.to(device)).pooler_output
        patch = int(ctx.lm.config.vision_config.patch_size)
        frames = torch.tensor([ctx.request.videos[k].num_frames for k in items], dtype=torch.float64)
        megapixels = float((grid[:, 1:].prod(-1).double() * frames).sum()) * patch * patch / 1e6
        return (features if isinstance(features, torch.Tensor) else torch.cat(features, dim=0)), megapixels

    @staticmethod
    def image_token_id(ctx: "Context") -> int:
        return int(ctx.lm.config.image_token_id)

    @staticmethod
    def video_token_id(ctx: "Context") -> int:
        return int(ctx.lm.config.video_token_id)

    def mm_token_type_ids(self, ctx: "Context") -> torch.Tensor:
        """0 text, 1 image, 2 video per position: the processor's, or derived from the ids."""
        given = ctx.model_inputs.get("mm_token_type_ids")
        if given is not None:
            return given.to(ctx.input_ids.device)
        types = (ctx.input_ids == self.image_token_id(ctx)).long()
        video = getattr(ctx.lm.config, "video_token_id", None)
        if video is not None:
            types = types + 2 * (ctx.input_ids == int(video)).long()
        return types


class Qwen25VLFamily(Qwen2VLFamily):
    """Qwen2.5-VL: same contract; windowed attention in the vision tower is the model's business."""

    name = "qwen2.5-vl"
    model_types = ("qwen2_5_vl",)
    auto_class = "Qwen2_5_VLForConditionalGeneration"


def image_spans(ctx: "Context") -> list[tuple[int, int]]:
    """[start, end) of each image's placeholder run in the prompt, in image order.

    Sizes come from ``image_grid_thw`` (tokens = t*h*w / merge**2), so two adjacent images
    are still told apart.
    """
    return _spans(ctx, "image_grid_thw", Qwen2VLFamily.image_token_id, "image")


def video_spans(ctx: "Context") -> list[tuple[int, int]]:
    """[start, end) of each video's placeholder run in the prompt, in video order (sizes from
    ``video_grid_thw``, as for images)."""
    return _spans(ctx, "video_grid_thw", Qwen2VLFamily.video_token_id, "video")


def _spans(ctx: "Context", key: str, token_id: Any, kind: str) -> list[tuple[int, int]]:
    grid = ctx.model_inputs.get(key)
    if grid is None:
        return []
    merge = int(ctx.lm.config.vision_config.spatial_merge_size)
    sizes = (grid.prod(-1) // merge**2).tolist()
    return placeholder_spans(ctx.input_ids[0], token_id(ctx), sizes, kind)


def select_items(grid: torch.Tensor, pixel_values: torch.Tensor, items: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid rows and patch rows of ``items``: patches are concatenated item after item."""
    if len(items) == grid.shape[0]:
        return grid, pixel_values
    ends = grid.prod(-1).cumsum(0).tolist()
    rows = torch.cat([pixel_values[(ends[k - 1] if k else 0) : ends[k]] for k in items], dim=0)
    return grid[items], rows
