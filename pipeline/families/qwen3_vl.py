"""Qwen3-VL: Qwen2-VL's placeholders, cache keys and 4-row positions, plus **deepstack**, for
images and video.

What is particular to it:

- the vision tower also returns features from a few of its blocks (``deepstack_visual_indexes``);
  the language model adds feature ``i`` to the hidden states at image positions after decoder
  layer ``i``. ``generate()`` does this inside one forward from ``visual_pos_masks`` and
  ``deepstack_visual_embeds``; here the vision stage keeps the features per prompt position
  (``ctx.model_inputs[DEEPSTACK]``), each prefill chunk carries its slice
  (``chunk_extras``), and the packed forward hands them to the decoder in packed order
  (``lm_inputs``), so chunked, batched and partly cached prompts get exactly those additions;
- a video is one placeholder run per temporal patch, each after its timestamp text
  (``<0.5 seconds>``); a video's span covers them all, and ``encode_videos`` hands the text
  positions their own embeddings back, so merging the span changes only the placeholders;
- interleaved M-RoPE (``mrope_interleaved``) is the model's business: positions come from its
  own ``get_rope_index``, which splits each video into its temporal patches;
- the 4B Instruct template has no thinking switch (``thinking=`` changes nothing), the
  Thinking checkpoints always think.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from pipeline.families.qwen2_vl import Qwen2VLFamily, select_items, video_spans

if TYPE_CHECKING:
    from pipeline.context import Context

DEEPSTACK = "deepstack"  # ctx.model_inputs key: (visual mask [L], features [layers, L, hidden])


class Qwen3VLFamily(Qwen2VLFamily):
    """Qwen3-VL: Qwen2-VL's contract plus deepstack features as an extra decoder input."""

    name = "qwen3-vl"
    model_types = ("qwen3_vl",)
    auto_class = "Qwen3VLForConditionalGeneration"

    def encode_images(self, ctx: "Context", items: list[int]) -> tuple[torch.Tensor, float]:
        """The embeddings of images ``items`` through the tower, and the megapixels it saw; their
        deepstack features are kept per prompt position for the prefill chunks."""
        grid, pixel_values = select_items(ctx.model_inputs["image_grid_thw"], ctx.model_inputs["pixel_values"], items)
        features = self._encode(
            ctx, "get_image_features", pixel_values, grid, self.image_spans(ctx), items, self.image_token_id(ctx)
        )
        return features, float(grid[:, 1:].prod(-1).sum()) * self._patch_area(ctx) / 1e6

    def video_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        """[first, last + 1) of each video's placeholders: the processor writes one run per
        temporal patch with its timestamp text (``<0.5 seconds>``) between them, so a span also
        covers that text (``encode_videos`` gives those positions their own embeddings back)."""
        return video_spans(ctx)

    def encode_videos(self, ctx: "Context", items: list[int]) -> tuple[torch.Tensor, float]:
        """Rows for the whole span of each video in ``items``: the tower's embeddings at its
        placeholders, and the prompt's own embeddings at the timestamp text between them."""
        grid, pixel_values = select_items(
            ctx.model_inputs["video_grid_thw"], ctx.model_inputs["pixel_values_videos"], items
        )
        spans = self.video_spans(ctx)
        token = self.video_token_id(ctx)
        features = self._encode(ctx, "get_video_features", pixel_values, grid, spans, items, token)
        rows, offset = [], 0
        for k in items:
            start, end = spans[k]
            span = ctx.inputs_embeds[0, start:end].clone()
            pads = ctx.input_ids[0, start:end] == token
            count = int(pads.sum())
            span[pads] = features[offset : offset + count].to(span.dtype)
            rows.append(span)
            offset += count
        frames = torch.tensor([ctx.request.videos[k].num_frames for k in items], dtype=torch.float64)
        megapixels = float((grid[:, 1:].prod(-1).double() * frames).sum()) * self._patch_area(ctx) / 1e6
        return torch.cat(rows, dim=0), megapixels

    def _encode(
        self,
        ctx: "Context",
        hook: str,
        pixel_values: torch.Tensor,
        grid: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        items: list[int],
        token: int,
    ) -> torch.Tensor:
        """The tower's embeddings of ``items`` (concatenated); their deepstack features are kept
        at the items' placeholder positions (``ctx.model_inputs[DEEPSTACK]``)."""
        model = ctx.lm.model.model
        device = next(model.visual.parameters()).device
        out = getattr(model, hook)(pixel_values.to(device), grid.to(device))
        ids = ctx.input_ids[0]
        positions = torch.cat(
            [start + (ids[start:end] == token).nonzero().view(-1).cpu() for start, end in (spans[k] for k in items)]
        )  # the kept rows live on the host until packed
        kept = ctx.model_inputs.get(DEEPSTACK)
        if kept is None:
            length, layers = ids.shape[0], len(out.deepstack_features)
            hidden = out.deepstack_features[0][0].shape[-1]
            kept = ctx.model_inputs[DEEPSTACK] = (
                torch.zeros(length, dtype=torch.bool),
                torch.zeros(layers, length, hidden, dtype=out.deepstack_features[0][0].dtype),
            )
        mask, features = kept
        mask[positions] = True
        for layer, rows in enumerate(out.deepstack_features):
            features[layer, positions] = torch.cat(list(rows), dim=0).to(features.device, features.dtype)
        return torch.cat(list(out.pooler_output), dim=0)

    @staticmethod
    def _patch_area(ctx: "Context") -> int:
        return int(ctx.lm.config.vision_config.patch_size) ** 2

    # --- the extra decoder input -------------------------------------------------------------
    def chunk_extras(self, ctx: "Context", begin: int, end: int) -> dict | None:
        kept = ctx.model_inputs.get(DEEPSTACK)
        if kept is None or not bool(kept[0][begin:end].any()):
            return None
        mask, features = kept
        return {"visual": mask[begin:end], "deepstack": features[:, begin:end]}

    def lm_inputs(self, chunks: Sequence[Any], device: torch.device) -> dict[str, Any]:
        """``visual_pos_masks`` [1, T] over the packed tokens and one [visual tokens, hidden]
        tensor per deepstack layer, rows in packed order (what Qwen3VLTextModel adds)."""
        masks: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for c in chunks:
            mask = torch.zeros(c.count, dtype=torch.bool)
            if c.extras:
                visual = c.extras["visual"]
                mask[: len(visual)] = visual
                rows.append(c.extras["deepstack"][:, visual])
            masks.append(mask)
        features = torch.cat(rows, dim=1).to(device)
        return {
            "visual_pos_masks": torch.cat(masks).view(1, -1).to(device),
            "deepstack_visual_embeds": list(features.unbind(0)),
        }
