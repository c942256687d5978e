"""VisionEncoder: images -> patch embeddings (the model's own vision tower) -> merged prompt embeddings."""
from __future__ import annotations

import torch

from pipeline.context import Context
from pipeline.families.base import scatter_media
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
        token_id = int(lm.config.image_token_id)
        m.set("image_tokens", sum(end - start for start, end in spans))
        # What Prefill will keep from the cache (it always recomputes at least the last token).
        reused = min(ctx.cache.common_prefix(ctx.token_keys), ctx.input_ids.shape[1] - 1)
        todo = [k for k, (_, end) in enumerate(spans) if end > reused]
        if ctx.inputs_embeds is None:
            ctx.inputs_embeds = lm.model.get_input_embeddings()(ctx.input_ids)
        m.set("megapixels", 0.0)
        if not todo:
            return ctx
        pixel_values, sub_grid = self._select(ctx.model_inputs["pixel_values"], grid, todo)
        visual = lm.model.model.visual
        device = next(visual.parameters()).device
        features = lm.model.model.get_image_features(pixel_values.to(device), sub_grid.to(device)).pooler_output
        patch = int(lm.config.vision_config.patch_size)
        m.set("megapixels", float(sub_grid[:, 1:].prod(-1).sum()) * patch * patch / 1e6)
        # scatter_media fills every placeholder at once: cached images keep what is already there.
        mask = ctx.input_ids[0] == token_id
        embeds = ctx.inputs_embeds[0, mask].clone()
        offset = 0
        for k, (start, end) in enumerate(spans):
            n = end - start
            if k in todo:
                embeds[offset : offset + n] = features[todo.index(k)].to(embeds.device, embeds.dtype)
            offset += n
        scatter_media(ctx, token_id, embeds)
        return ctx

    @staticmethod
    def _select(pixel_values: torch.Tensor, grid: torch.Tensor, keep: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The patch rows and grid of the images in ``keep`` (rows are concatenated per image)."""
        if len(keep) == grid.shape[0]:
            return pixel_values, grid
        rows = grid.prod(-1).tolist()
        starts = [sum(rows[:k]) for k in range(len(rows))]
        parts = [pixel_values[starts[k] : starts[k] + rows[k]] for k in keep]
        return torch.cat(parts, dim=0), grid[keep]
