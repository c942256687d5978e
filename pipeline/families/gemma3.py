"""Gemma 3 (google/gemma-3-4b-it): fixed-size image blocks attended both ways, sliding-window layers.

What is particular to it, so that the stages stay generic:

- the processor turns each ``<start_of_image>`` of the rendered prompt into
  ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` ``<image_soft_token>`` + ``<end_of_image>\\n\\n``
  (256 soft tokens for the 4B model, every image resized to one square); with pan-and-scan
  (``model.processor.do_pan_and_scan=true``, off by default as published) a wide or tall image
  becomes its thumbnail plus up to 4 crops, each such a block. A block is one "sub-image" here:
  its own pixel rows, its own placeholder span, its own cache-key hash (of the exact pixels the
  tower sees);
- during prefill the soft tokens of one block attend to each other both ways (transformers
  builds this from ``token_type_ids``: full layers OR(causal, block), sliding layers
  AND(window, OR(causal, block))). :meth:`bidirectional_spans` names the blocks; the paged
  attention ors them into the prefill mask and the engine never ends a prefill chunk inside one.
  Decode steps are plain causal, as in ``generate()``;
- five of every six decoder layers attend over a sliding window (1024 tokens for the 4B model).
  The paged pool keeps **every** position for them too (no KV memory is saved: blocks are shared
  by all layers, and reuse, rollback, ``/undo`` and the prefix cache need the whole history);
  their attention masks keys older than the window, with transformers' rule;
- positions are plain 1-D, the BOS comes from the template (the tokenizer would add a second).

``Gemma3TextFamily`` runs the text-only checkpoints (``gemma3_text``, e.g. gemma-3-1b-it) the same
way, without images.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Sequence

import torch

from pipeline.errors import UserError
from pipeline.families.base import Family, TextFamily, media_keys, media_name, placeholder_spans
from pipeline.families.qwen2_vl import load_images
from pipeline.media import content_hash

if TYPE_CHECKING:
    from pipeline.context import Context

IMAGE_HASHES = "image_hashes"  # ctx.model_inputs key: one content hash per sub-image, prompt order


class Gemma3Family(Family):
    """Gemma 3 with its SigLIP tower: fixed-size image blocks, bidirectional within each."""

    name = "gemma3"
    model_types = ("gemma3",)
    auto_class = "Gemma3ForConditionalGeneration"
    media = ("image",)
    encoder_modules = ("vision_tower", "multi_modal_projector")
    uses_processor = True

    # --- tokenize ---------------------------------------------------------------------------
    def process(self, lm: Any, text: str, request: Any) -> dict:
        """Processor outputs for the rendered prompt and its images, plus ``image_hashes``: one
        content hash per sub-image (an image, or with pan-and-scan its thumbnail and each crop)
        of the pixels the tower will see, for the cache keys."""
        pan_and_scan = getattr(lm.processor.image_processor, "do_pan_and_scan", None)
        if pan_and_scan is not None and not isinstance(pan_and_scan, bool):
            raise UserError(f"model.processor.do_pan_and_scan must be true or false (got {pan_and_scan!r})")
        images = load_images(list(request.images))
        marker = lm.processor.boi_token
        if text.count(marker) != len(images):
            raise UserError(
                f"the prompt has {text.count(marker)} image placeholder(s) but {len(images)} image(s) were given"
            )
        bos = lm.tokenizer.bos_token
        # As the processor's apply_chat_template: the template wrote the BOS, the tokenizer must not.
        kwargs = {"add_special_tokens": False} if bos and text.startswith(bos) else {}
        try:
            out = dict(lm.processor(text=[text], images=images or None, return_tensors="pt", **kwargs))
        except ValueError as err:
            names = ", ".join(media_name(src, "image", i) for i, src in enumerate(request.images))
            reason = " ".join(str(err).split())
            raise UserError(f"{names or 'the prompt'}: the Gemma 3 processor refused it: {reason}") from None
        pixels = out.get("pixel_values")
        out[IMAGE_HASHES] = [content_hash(p) for p in pixels] if pixels is not None else []
        return out

    def token_keys(self, ctx: "Context") -> list[Hashable]:
        """Token ids, except soft-token positions: ``(image_token_id, content hash, index)``."""
        return media_keys(ctx.input_ids[0].tolist(), self.image_spans(ctx), ctx.model_inputs.get(IMAGE_HASHES) or [])

    # --- what the vision stage asks ----------------------------------------------------------
    def image_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        """[start, end) of each sub-image's soft-token run, in prompt order (``mm_tokens_per_image`` each)."""
        pixels = ctx.model_inputs.get("pixel_values")
        if pixels is None:
            return []
        size = int(ctx.lm.config.mm_tokens_per_image)
        return placeholder_spans(ctx.input_ids[0], self.image_token_id(ctx), [size] * pixels.shape[0], "image")

    def encode_images(self, ctx: "Context", items: list[int]) -> tuple[torch.Tensor, float]:
        """Soft-token embeddings of sub-images ``items`` (concatenated in that order) through the
        model's own tower and projector, and the megapixels the tower saw."""
        model = ctx.lm.model.model
        device = next(model.vision_tower.parameters()).device
        pixels = ctx.model_inputs["pixel_values"][items].to(device)
        features = model.get_image_features(pixels).pooler_output  # [items, tokens, hidden]
        megapixels = len(items) * pixels.shape[-2] * pixels.shape[-1] / 1e6
        return features.reshape(-1, features.shape[-1]), float(megapixels)

    @staticmethod
    def image_token_id(ctx: "Context") -> int:
        return int(ctx.lm.config.image_token_id)

    # --- attention ----------------------------------------------------------------------------
    def bidirectional_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        """Runs of image tokens (``token_type_ids == 1``), exactly the blocks transformers'
        ``get_block_sequence_ids_for_mask`` makes: two images are two blocks (their markers
        and newlines lie between them)."""
        types = ctx.model_inputs.get("token_type_ids")
        image = (types[0] == 1) if types is not None else (ctx.input_ids[0].cpu() == self.image_token_id(ctx))
        return runs(image.tolist())


class Gemma3TextFamily(TextFamily):
    """Text-only Gemma 3 (``Gemma3ForCausalLM``): plain text, sliding-window layers."""

    name = "gemma3-text"
    model_types = ("gemma3_text",)


def runs(flags: Sequence[bool]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of True in ``flags``."""
    out: list[tuple[int, int]] = []
    start = None
    for i, flag in enumerate(flags):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(flags)))
    return out
