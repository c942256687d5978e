"""VisionEncoder: images -> the family's vision tower -> embeddings merged at their placeholders."""
from __future__ import annotations

from pipeline.context import Context
from pipeline.families.base import merge_media, prompt_embeds, uncached_items


class VisionEncoder:
    """Encodes the prompt's images and writes them over their placeholder embeddings.

    The model knowledge (placeholder runs, the tower, its inputs) lives in the family
    (``image_spans``, ``encode_images``); this stage decides what to encode and counts. Images
    whose placeholder tokens the KV cache already holds are not encoded again: Prefill computes
    only the suffix, so their embeddings would never be read (a follow-up question about the
    same picture costs no vision time). The cache keys carry each image's content hash, so only
    the very same pixels count as cached.

    Counters: ``image_tokens`` (placeholders in the prompt) and ``megapixels`` (pixels the
    encoder actually saw, after dynamic resizing).
    """

    def skip(self, ctx: Context) -> bool:
        """Nothing to do for a prompt without images (text-only models always skip)."""
        return not ctx.request.images

    def __call__(self, ctx: Context) -> Context:
        family, m = ctx.lm.family, ctx.metrics
        spans = family.image_spans(ctx)
        m.set("image_tokens", sum(end - start for start, end in spans))
        m.set("megapixels", 0.0)
        prompt_embeds(ctx)
        todo = uncached_items(ctx, spans)
        if not todo:
            return ctx
        embeds, megapixels = family.encode_images(ctx, todo)
        m.set("megapixels", megapixels)
        merge_media(ctx, spans, todo, embeds)
        return ctx
