"""VisionEncoder: images and video -> the family's vision tower -> embeddings merged at their placeholders."""

from __future__ import annotations

from pipeline.context import Context
from pipeline.families.base import merge_media, prompt_embeds, uncached_items

# Per kind: the request field, and the family hooks giving placeholder runs and encodings.
KINDS: tuple[tuple[str, str, str, str], ...] = (
    ("image", "images", "image_spans", "encode_images"),
    ("video", "videos", "video_spans", "encode_videos"),
)


class VisionEncoder:
    """Encodes the prompt's images and videos and writes them over their placeholder embeddings.

    The model knowledge (placeholder runs, the tower, its inputs) lives in the family
    (``image_spans`` / ``encode_images``, ``video_spans`` / ``encode_videos``); this stage decides
    what to encode and counts. Items whose placeholder tokens the KV cache already holds are not
    encoded again: Prefill computes only the suffix, so their embeddings would never be read (a
    follow-up question about the same picture or clip costs no vision time). The cache keys
    carry each item's content hash, so only the very same pixels count as cached.

    Counters: ``image_tokens`` / ``video_tokens`` (placeholders in the prompt), ``megapixels``
    (pixels the encoder actually saw, after dynamic resizing, video frames included), and for
    the videos it encoded ``video_frames`` (sampled frames) and ``video_seconds`` (the span of
    the source they were sampled from).
    """

    media_kinds = ("image", "video")  # what it encodes: a request with these needs it (engine.intake.check_media)

    def skip(self, ctx: Context) -> bool:
        """Nothing to do for a prompt without images or videos (text-only models always skip)."""
        return not (ctx.request.images or ctx.request.videos)

    def __call__(self, ctx: Context) -> Context:
        family, m, request = ctx.lm.family, ctx.metrics, ctx.request
        prompt_embeds(ctx)
        megapixels = 0.0
        for kind, field, spans_hook, encode_hook in KINDS:
            items = getattr(request, field)
            if not items:
                continue
            spans = getattr(family, spans_hook)(ctx)
            # A span starts at its first placeholder; it may also cover text between its runs
            # (Qwen3-VL's frame timestamps), which is not counted.
            ids = ctx.input_ids[0]
            m.set(f"{kind}_tokens", sum(int((ids[start:end] == ids[start]).sum()) for start, end in spans))
            todo = uncached_items(ctx, spans)
            if kind == "video":
                m.set("video_frames", sum(items[k].num_frames for k in todo))
                m.set("video_seconds", float(sum(items[k].duration for k in todo)))
            if not todo:
                continue
            embeds, seen = getattr(family, encode_hook)(ctx, todo)
            megapixels += seen
            merge_media(ctx, spans, todo, embeds)
        m.set("megapixels", megapixels)
        return ctx
