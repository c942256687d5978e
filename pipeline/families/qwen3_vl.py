"""Qwen3-VL: Qwen2-VL's placeholders, cache keys and 4-row positions, plus **deepstack**.

What is particular to it:

- the vision tower also returns features from a few of its blocks (``deepstack_visual_indexes``);
  the language model adds feature ``i`` to the hidden states at image positions after decoder
  layer ``i``. ``generate()`` does this inside one forward from ``visual_pos_masks`` and
  ``deepstack_visual_embeds``; here the vision stage keeps the features per prompt position
  (``ctx.model_inputs[DEEPSTACK]``), each prefill chunk carries its slice
  (``chunk_extras``), and the packed forward hands them to the decoder in packed order
  (``lm_inputs``), so chunked, batched and partly cached prompts get exactly those additions;
- interleaved M-RoPE (``mrope_interleaved``) and timestamps between video frames are the
  model's and processor's business: positions come from its own ``get_rope_index``;
- the 4B Instruct template has no thinking switch (``thinking=`` changes nothing), the
  Thinking checkpoints always think.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from pipeline.families.qwen2_vl import Qwen2VLFamily

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
        lm = ctx.lm
        grid = ctx.model_inputs["image_grid_thw"]
        pixel_values = ctx.model_inputs["pixel_values"]
        if len(items) != grid.shape[0]:  # patch rows are concatenated per image: keep those of `items`
            ends = grid.prod(-1).cumsum(0).tolist()
            pixel_values = torch.cat([pixel_values[(ends[k - 1] if k else 0) : ends[k]] for k in items], dim=0)
            grid = grid[items]
        device = next(lm.model.model.visual.parameters()).device
        out = lm.model.model.get_image_features(pixel_values.to(device), grid.to(device))
        features = torch.cat(list(out.pooler_output), dim=0)
        deepstack = [torch.cat(list(layer), dim=0) for layer in out.deepstack_features]
        spans = self.image_spans(ctx)
        self._keep_deepstack(ctx, [spans[k] for k in items], deepstack)
        patch = int(lm.config.vision_config.patch_size)
        megapixels = float(grid[:, 1:].prod(-1).sum()) * patch * patch / 1e6
        return features, megapixels

    @staticmethod
    def _keep_deepstack(ctx: "Context", spans: Sequence[tuple[int, int]], deepstack: list[torch.Tensor]) -> None:
        """Write the deepstack rows of the encoded items at their prompt positions."""
        length = ctx.input_ids.shape[1]
        kept = ctx.model_inputs.get(DEEPSTACK)
        if kept is None:
            rows = deepstack[0]
            kept = (torch.zeros(length, dtype=torch.bool),
                    rows.new_zeros(len(deepstack), length, rows.shape[-1]))
            ctx.model_inputs[DEEPSTACK] = kept
        mask, features = kept
        offset = 0
        for start, end in spans:
            mask[start:end] = True
            for layer, rows in enumerate(deepstack):
                features[layer, start:end] = rows[offset : offset + end - start].to(features.dtype)
            offset += end - start

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
        return {"visual_pos_masks": torch.cat(masks).view(1, -1).to(device),
                "deepstack_visual_embeds": list(features.unbind(0))}
