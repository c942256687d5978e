"""Qwen2-VL and Qwen2.5-VL: dynamic-resolution images, content-hashed cache keys, 3-D (M-RoPE) positions.

What is particular to these models, so that the stages can stay generic:

- the processor resizes each image to a multiple of 28 px within ``[min_pixels, max_pixels]``
  and expands one ``<|image_pad|>`` per image into ``grid_t * grid_h * grid_w / merge**2`` tokens;
- every image placeholder position gets the cache key ``(token_id, content_hash(image), index)``,
  so a cached image is never mistaken for another image that happens to have the same size;
- positions are 4 rows, the layout transformers 5.23's own ``generate`` feeds the model: row 0
  is the plain text position (the cache index, which the attention mask is built from) and rows
  1-3 are the temporal/height/width M-RoPE positions from ``model.model.get_rope_index``.
  After the prompt, M-RoPE positions run ``rope_deltas`` ahead of the text position; that delta
  is per request and lives in ``ctx.cache.state`` (never in the model, which would leak it
  between requests).
"""
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, Hashable

import torch
from PIL import Image

from pipeline.errors import UserError
from pipeline.families.base import Family, media_keys, media_name, placeholder_spans
from pipeline.media import content_hash, load_image, to_rgb

if TYPE_CHECKING:
    from pipeline.context import Context

IMAGE_PAD = "<|image_pad|>"
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


class Qwen2VLFamily(Family):
    """Qwen2-VL: images through the model's own vision tower; 3-D rotary positions."""

    name = "qwen2-vl"
    model_types = ("qwen2_vl",)
    auto_class = "Qwen2VLForConditionalGeneration"
    media = ("image",)
    encoder_modules = ("visual",)
    uses_processor = True

    # --- tokenize ---------------------------------------------------------------------------
    def process(self, lm: Any, text: str, request: Any) -> dict:
        """Processor outputs for the rendered prompt and its images (dynamic resolution).

        Also returns ``image_hashes`` (one content hash per image, in prompt order) for the
        cache keys, computed here once so that paths are decoded only once.
        """
        images = load_images(list(request.images))
        placeholders = text.count(IMAGE_PAD)
        if placeholders != len(images):
            raise UserError(
                f"the prompt has {placeholders} image placeholder(s) but {len(images)} image(s) were given"
            )
        try:
            with warnings.catch_warnings():
                # min_pixels/max_pixels given to from_pretrained (model.processor) are replayed by
                # transformers 5.23 on every call with a deprecation warning; they still apply.
                warnings.filterwarnings("ignore", "Passing `min_pixels` and `max_pixels`", FutureWarning)
                out = dict(lm.processor(text=[text], images=images or None, return_tensors="pt"))
        except ValueError as err:  # e.g. an aspect ratio beyond 200:1, which smart_resize refuses
            names = ", ".join(
                f"{media_name(src, 'image', i)} ({im.size[0]}x{im.size[1]})"
                for i, (src, im) in enumerate(zip(request.images, images))
            )
            raise UserError(f"{names}: the image processor refused it: {' '.join(str(err).split())}") from None
        out["image_hashes"] = [content_hash(im) for im in images]
        return out

    def token_keys(self, ctx: "Context") -> list[Hashable]:
        """Token ids, except image positions: ``(image_token_id, content hash, index in that image)``."""
        return media_keys(ctx.input_ids[0].tolist(), image_spans(ctx), ctx.model_inputs.get("image_hashes") or [])

    # --- positions --------------------------------------------------------------------------
    def prompt_positions(self, ctx: "Context", start: int) -> torch.Tensor:
        """[4, 1, L - start] positions of prompt tokens [start:]; stores rope_deltas in the cache state."""
        ids = ctx.input_ids
        length = ids.shape[1]
        text_pos = torch.arange(length, device=ids.device).view(1, 1, -1)
        grid = ctx.model_inputs.get("image_grid_thw")
        if grid is not None and bool((ids == self.image_token_id(ctx)).any()):
            rope, deltas = ctx.lm.model.model.get_rope_index(
                ids,
                mm_token_type_ids=self.mm_token_type_ids(ctx),
                image_grid_thw=grid.to(ids.device),
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
        lm = ctx.lm
        grid = ctx.model_inputs["image_grid_thw"]
        pixel_values = ctx.model_inputs["pixel_values"]
        if len(items) != grid.shape[0]:  # patch rows are concatenated per image: keep those of `items`
            ends = grid.prod(-1).cumsum(0).tolist()
            pixel_values = torch.cat([pixel_values[(ends[k - 1] if k else 0) : ends[k]] for k in items], dim=0)
            grid = grid[items]
        device = next(lm.model.model.visual.parameters()).device
        features = lm.model.model.get_image_features(pixel_values.to(device), grid.to(device)).pooler_output
        patch = int(lm.config.vision_config.patch_size)
        megapixels = float(grid[:, 1:].prod(-1).sum()) * patch * patch / 1e6
        return (features if isinstance(features, torch.Tensor) else torch.cat(features, dim=0)), megapixels

    @staticmethod
    def image_token_id(ctx: "Context") -> int:
        return int(ctx.lm.config.image_token_id)

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
    grid = ctx.model_inputs.get("image_grid_thw")
    if grid is None:
        return []
    merge = int(ctx.lm.config.vision_config.spatial_merge_size)
    sizes = (grid.prod(-1) // merge**2).tolist()
    return placeholder_spans(ctx.input_ids[0], Qwen2VLFamily.image_token_id(ctx), sizes, "image")
