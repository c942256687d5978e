"""VisionEncoder: images -> patch embeddings (the model's own vision tower) -> merged prompt embeddings."""
from __future__ import annotations

import torch

from pipeline.context import Context
from pipeline.families.base import merge_media, prompt_embeds, uncached_items
from pipeline.families.qwen2_vl import image_spans


class VisionEncoder:
    """Encodes the prompt's images and writes them over their placeholder embeddings.

    Images whose placeholder tokens the KV cache already holds are not encoded again: Prefill
    computes only the suffix, so their embeddings would never be read (a follow-up question
    about the same picture costs no vision time). The cache keys carry each image's content
    hash, so only the very same pixels count as cached.

    Counters: ``image_tokens`` (placeholders in the prompt) and ``megapixels`` (pixels the
    encoder actually saw, after dynamic resizing).
    """

    def skip(self, ctx: Context) -> bool:
        """Nothing to do for a prompt without images (text-only models always skip)."""
        return ctx.model_inputs.get("pixel_values") is None

    def __call__(self, ctx: Context) -> Context:
        lm, m = ctx.lm, ctx.metrics
        grid = ctx.model_inputs["image_grid_thw"]
        spans = image_spans(ctx)
        m.set("image_tokens", sum(end - start for start, end in spans))
        m.set("megapixels", 0.0)
        prompt_embeds(ctx)
        todo = uncached_items(ctx, spans)
        if not todo:
            return ctx
        pixel_values, sub_grid = self._select(ctx.model_inputs["pixel_values"], grid, todo)
        device = next(lm.model.model.visual.parameters()).device
        features = lm.model.model.get_image_features(pixel_values.to(device), sub_grid.to(device)).pooler_output
        patch = int(lm.config.vision_config.patch_size)
        m.set("megapixels", float(sub_grid[:, 1:].prod(-1).sum()) * patch * patch / 1e6)
        embeds = features if isinstance(features, torch.Tensor) else torch.cat(features, dim=0)  # per-image tuple
        merge_media(ctx, spans, todo, embeds)
        return ctx

    @staticmethod
    def _select(pixel_values: torch.Tensor, grid: torch.Tensor, keep: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The patch rows and grid of the images in ``keep`` (rows are concatenated per image)."""
        if len(keep) == grid.shape[0]:
            return pixel_values, grid
        ends = grid.prod(-1).cumsum(0).tolist()
        parts = [pixel_values[(ends[k - 1] if k else 0) : ends[k]] for k in keep]
        return torch.cat(parts, dim=0), grid[keep]
