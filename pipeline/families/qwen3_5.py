"""Qwen3.5: Qwen3-VL's images and video without deepstack, in front of a hybrid decoder.

What is particular to it:

- the vision side is Qwen3-VL's: the same processor (``Qwen3VLProcessor``, 16 px patches merged
  2 x 2), the same placeholders and cache keys, a video as one placeholder run per temporal
  patch after its timestamp text, and the same ``get_rope_index`` (interleaved M-RoPE, each video
  split into its temporal patches), so positions are Qwen2-VL's 4 rows with ``rope_deltas`` in
  the cache state;
- but the tower returns only its merged embeddings: no deepstack features, so no extra decoder
  input (no ``chunk_extras``, no ``lm_inputs``);
- the decoder's layers are Gated DeltaNet (``linear_attention``, a recurrent state per sequence)
  and gated full attention, three to one in the published checkpoints: what the KV cache must
  hold for them is the cache's business (``pipeline.kv.states``), not this file's;
- the small checkpoints' template does not think unless asked (``thinking=true``).

``Qwen3_5TextFamily`` runs the text-only ``Qwen3_5ForCausalLM`` (``qwen3_5_text``) with plain
positions: its model expands 1-D positions to its 4 rows itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from pipeline.families.base import Family, TextFamily
from pipeline.families.qwen3_vl import Qwen3VLFamily

if TYPE_CHECKING:
    from pipeline.context import Context

# Gated DeltaNet's gate projections have one output per value head (16 in Qwen3.5-0.8B, 4 in the
# tiny model), which bitsandbytes' CPU 4-bit kernel cannot pack (out_features must divide by 32);
# they are a few kilobytes a layer, so 4-bit would save nothing anyway. Both families keep them.
UNQUANTISED = ("in_proj_a", "in_proj_b")


class Qwen3_5Family(Qwen3VLFamily):
    """Qwen3.5 (``Qwen3_5ForConditionalGeneration``): Qwen3-VL's contract minus deepstack."""

    name = "qwen3.5"
    model_types = ("qwen3_5",)
    auto_class = "Qwen3_5ForConditionalGeneration"
    unquantised_modules = UNQUANTISED

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
        """The tower's merged embeddings of ``items`` (concatenated in that order); nothing kept."""
        model = ctx.lm.model.model
        device = next(model.visual.parameters()).device
        out = getattr(model, hook)(pixel_values.to(device), grid.to(device))
        return torch.cat(list(out.pooler_output), dim=0)

    # No deepstack: no per-token inputs beyond ids, embeddings and positions.
    chunk_extras = Family.chunk_extras
    lm_inputs = Family.lm_inputs


class Qwen3_5TextFamily(TextFamily):
    """Text-only Qwen3.5 (``Qwen3_5ForCausalLM``): plain text, Gated DeltaNet and full-attention layers."""

    name = "qwen3.5-text"
    model_types = ("qwen3_5_text",)
    unquantised_modules = UNQUANTISED
