"""What every family shares: plain 1-D positions, no media. Multimodal families override hooks;
the media helpers at the end (placeholder spans, cache keys, merging) serve every media encoder.

Adding a family (what ``qwen2_vl.py`` and ``qwen2_audio.py`` did):

1. ``pipeline/families/<name>.py``: a ``Family`` subclass with ``name``, ``model_types`` (the
   config.json ``model_type`` values it runs: the registry finds the class there, nothing else
   to edit), ``auto_class``, ``media``, ``encoder_modules`` (kept unquantised, left out of the
   decode-bytes figure), and the hooks its model needs: ``content`` (a user message's parts),
   ``prepare`` / ``process`` (media through its processor), ``token_keys`` (content hashes at
   placeholder positions), ``prompt_positions`` / ``decode_positions`` (e.g. 3-D rope rows),
   and for its encoders ``image_spans`` + ``encode_images``, ``video_spans`` + ``encode_videos`` or
   ``audio_spans`` + ``encode_audio``
   (the stages in ``stages/vision_encoder.py`` and ``stages/audio_encoder.py`` only ask these);
   ``bidirectional_spans`` where prompt tokens attend both ways (Gemma 3's image blocks).
2. ``conf/model/<name>.yaml``: ``name`` and the hub ``path`` of its reference checkpoint.
3. ``pipeline/testing/<name>.py``: its tiny random-weight builder for the tests, which compare
   greedy output with ``generate()``: ``FAMILY``, ``RANK``, ``ROLES``, ``SPECIAL_TOKENS`` (in the
   published order), ``CHAT_TEMPLATE`` (the published one), ``make_config``, ``model_class`` and
   ``make_processor`` (the real processor classes). ``pipeline/testing/registry.py`` finds it.
4. Tests: greedy equality with ``generate()`` for each modality it takes, nf4 included.

Its layers must be full or sliding-window attention (the paged KV pool keeps every position
for both; a sliding layer's attention masks keys older than its window), or Gated DeltaNet
linear attention as Qwen3.5 has it (recurrent states: ``pipeline.kv.states``), declared by a
family of its own; a model with other layers (Mamba, chunked attention, convolutions) is
refused in one line.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Hashable, Sequence

import torch

from pipeline.errors import UserError

if TYPE_CHECKING:
    from pipeline.context import Context


class Family:
    """Hooks a family may override. The defaults describe a text-only causal LM."""

    name = "text"
    model_types: tuple[str, ...] = ()  # config.json model_type values it runs (the registry's key)
    auto_class = "AutoModelForCausalLM"  # the transformers class that loads the model
    media: tuple[str, ...] = ()  # "image", "audio": what its encoders take
    # Module names of its media encoders and projectors (anywhere in the model, at a module
    # boundary): kept unquantised by default, not counted in the bytes a decode step reads,
    # never mistaken for the decoder layers. The one place this list is written.
    encoder_modules: tuple[str, ...] = ()
    # Module names (matched as encoder_modules are) that quantisation never touches, whatever
    # quant.skip_modules says: layers bitsandbytes cannot pack (``pipeline.model.quant``).
    unquantised_modules: tuple[str, ...] = ()
    uses_processor = False  # load AutoProcessor (media) rather than AutoTokenizer
    # Rows of position_ids for text tokens (each row the plain position): what a draft model
    # reading the target's tokens as text feeds (``pipeline.spec``).
    position_rows = 1
    audio_in_video = False  # hears a video's own audio track (media.use_audio_in_video)

    def content(self, text: str, images: int, audios: int, kinds: Sequence[str] | None = None) -> Any:
        """One user message's content: a plain string for text models (their templates expect it).

        ``kinds``: the media kinds in prompt order (``["image", "video", "image"]``), so mixed
        prompts keep the order they were given in; without it, the images, then the audio clips.
        """
        if not self.media:
            return text
        order = list(kinds) if kinds is not None else ["image"] * images + ["audio"] * audios
        items: list[dict] = [{"type": kind} for kind in order]
        items.append({"type": "text", "text": text})
        return items

    @staticmethod
    def audio_rate(lm: Any) -> int:
        """The sample rate the model's feature extractor wants (16 kHz when it does not say):
        what uploaded or attached audio is decoded to."""
        extractor = getattr(lm.processor, "feature_extractor", None)
        return int(getattr(extractor, "sampling_rate", None) or 16_000)

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

    # --- attention ----------------------------------------------------------------------------
    def bidirectional_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        """[start, end) prompt spans whose tokens all see each other during prefill (Gemma 3's
        image blocks; the paged attention ors them into the causal mask). The engine never ends
        a prefill chunk inside one, so a block is computed with all of its keys. Default: none."""
        return []

    # --- extra forward inputs ---------------------------------------------------------------
    def chunk_extras(self, ctx: "Context", begin: int, end: int) -> dict | None:
        """Per-token inputs of prompt positions [begin, end) beyond ids, embeddings and positions
        (e.g. Qwen3-VL's deepstack features), carried by the engine's chunk; None: nothing."""
        return None

    def lm_inputs(self, chunks: Sequence[Any], device: torch.device) -> dict[str, Any]:
        """The language-model keyword inputs for one packed forward, built from its chunks'
        ``extras`` (in packed token order); called only when some chunk has extras. Default:
        none (extras the paged attention reads itself, such as bidirectional ``blocks``)."""
        return {}


class TextFamily(Family):
    pass


def media_name(item: Any, kind: str, index: int) -> str:
    """How to name a media item in a message: its file when known (a path, or ``info["source"]``
    on a PIL image), else its kind and rank."""
    if isinstance(item, (str, os.PathLike)):
        return str(item)
    info = getattr(item, "info", None)
    source = info.get("source") if isinstance(info, dict) else None
    return str(source) if source else f"{kind} {index + 1}"


def placeholder_spans(ids: torch.Tensor, token_id: int, sizes: Sequence[int], kind: str) -> list[tuple[int, int]]:
    """[start, end) of each media item's placeholder run in the prompt ``ids`` (1-D), in item order.

    ``sizes`` is how many placeholder tokens each item expands to, so two adjacent items are
    still told apart.
    """
    positions = (ids == token_id).nonzero().view(-1).tolist()
    if len(positions) != sum(sizes):
        raise UserError(f"the prompt has {len(positions)} {kind} tokens but its {kind} inputs need {sum(sizes)}")
    spans: list[tuple[int, int]] = []
    k = 0
    for size in sizes:
        spans.append((positions[k], positions[k + size - 1] + 1))
        k += size
    return spans


def media_keys(ids: list[int], spans: Sequence[tuple[int, int]], hashes: Sequence[str]) -> list[Hashable]:
    """Per-position cache keys: the token ids, except ``(token_id, content_hash, index in the item)``
    over each media item's placeholder span, so two different items never match."""
    keys: list[Hashable] = list(ids)
    for (start, end), digest in zip(spans, hashes):
        for j in range(start, end):
            keys[j] = (ids[j], digest, j - start)
    return keys


def prompt_embeds(ctx: "Context") -> torch.Tensor:
    """``ctx.inputs_embeds``, made from the token embeddings on first use, so that vision and
    audio encoders can both contribute to one prompt."""
    if ctx.inputs_embeds is None:
        ctx.inputs_embeds = ctx.lm.model.get_input_embeddings()(ctx.input_ids)
    return ctx.inputs_embeds


def uncached_items(ctx: "Context", spans: Sequence[tuple[int, int]]) -> list[int]:
    """Indices of the media items an encoder must encode: those with a placeholder past what
    Prefill will keep from the KV cache (``KVCache.reuse`` always leaves the last token to compute).
    The others' embeddings would never be read."""
    kept = min(ctx.cache.common_prefix(ctx.token_keys), ctx.input_ids.shape[1] - 1)
    return [k for k, (_, end) in enumerate(spans) if end > kept]


def merge_media(ctx: "Context", spans: Sequence[tuple[int, int]], items: Sequence[int], embeds: torch.Tensor) -> None:
    """Write media embeddings over their placeholders in the prompt embeddings.

    ``embeds`` holds the rows of ``items`` (indices into ``spans``), concatenated in that order.
    The other items' placeholders keep what they hold: they come from the KV cache.
    """
    target = prompt_embeds(ctx)
    need = sum(spans[k][1] - spans[k][0] for k in items)
    if embeds.shape[0] != need:
        raise ValueError(f"{need} placeholder tokens but {embeds.shape[0]} media embeddings")
    embeds = embeds.to(target.device, target.dtype)
    offset = 0
    for k in items:
        start, end = spans[k]
        target[0, start:end] = embeds[offset : offset + end - start]
        offset += end - start
