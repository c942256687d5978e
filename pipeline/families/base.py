"""What every family shares: plain 1-D positions, no media. Multimodal families override hooks."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable

import torch

if TYPE_CHECKING:
    from pipeline.context import Context


class Family:
    """Hooks a family may override. The defaults describe a text-only causal LM."""

    name = "text"
    auto_class = "AutoModelForCausalLM"  # the transformers class that loads the model
    media: tuple[str, ...] = ()  # "image", "audio": what its encoders take
    uses_processor = False  # load AutoProcessor (media) rather than AutoTokenizer

    def content(self, text: str, images: int, audios: int) -> Any:
        """One user message's content: a plain string for text models (their templates expect it)."""
        if not self.media:
            return text
        items: list[dict] = [{"type": "image"} for _ in range(images)]
        items += [{"type": "audio"} for _ in range(audios)]
        items.append({"type": "text", "text": text})
        return items

    def prepare(self, lm: Any, request: Any, long_audio: str = "split") -> Any:
        """The request with its media made ready for this model, before the template renders
        (audio families resample to the model's rate and split clips longer than the encoder
        window into several audio items). Returns a new Request; the default changes nothing."""
        return request

    def process(self, lm: Any, text: str, request: Any) -> dict:
        """Run the model's processor on the rendered prompt (media families pass their media)."""
        return lm.processor(text=[text], return_tensors="pt")

    def token_keys(self, ctx: "Context") -> list[Hashable]:
        """Per-position cache keys; media families add content hashes at placeholder positions."""
        return ctx.input_ids[0].tolist()

    def prompt_positions(self, ctx: "Context", start: int) -> torch.Tensor:
        """position_ids for prompt tokens [start:] (explicit, so no state lives in the model)."""
        end = ctx.input_ids.shape[1]
        return torch.arange(start, end, device=ctx.input_ids.device).unsqueeze(0)

    def decode_positions(self, ctx: "Context", position: int) -> torch.Tensor:
        """position_ids for one decode token at cache position ``position``.

        DecodeLoop calls this once per request and then adds 1 on the device for each further
        token (no host work per step), so every entry must advance by exactly 1 per position.
        """
        return torch.tensor([[position]], device=ctx.input_ids.device)


class TextFamily(Family):
    pass


def scatter_media(ctx: "Context", token_id: int, embeds: torch.Tensor) -> None:
    """Write media embeddings into the prompt embeddings at the placeholder positions.

    Creates ``ctx.inputs_embeds`` from the token embeddings on first use, so vision and audio
    encoders can both contribute to one prompt.
    """
    if ctx.inputs_embeds is None:
        ctx.inputs_embeds = ctx.lm.model.get_input_embeddings()(ctx.input_ids)
    mask = ctx.input_ids[0] == token_id
    if int(mask.sum()) != embeds.shape[0]:
        raise ValueError(f"{int(mask.sum())} placeholder tokens but {embeds.shape[0]} media embeddings")
    ctx.inputs_embeds[0, mask] = embeds.to(ctx.inputs_embeds.device, ctx.inputs_embeds.dtype)
