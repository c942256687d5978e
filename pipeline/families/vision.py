"""Any transformers image-text-to-text model, through the surface transformers 5.x gives them all
(issue 48): no per-model code.

- The model's own processor renders the prompt: it expands each image placeholder into the
  model's run (LLaVA's patch tokens, Idefics3's rows and columns, Pixtral's ``[IMG_BREAK]``s).
- Each image is also put through the processor alone (its placeholder and nothing else): that
  gives its own vision inputs (pixel values, ``image_sizes``, patch masks: whatever this model's
  processor makes) and how many image slots it fills, so images are told apart, hashed for the
  prefix cache and encoded one by one, whatever the model's pixel layout.
- ``get_image_features`` turns an image's inputs into its embeddings (``pooler_output`` or a
  tensor or a list of them), which go into the image slots of its run only: the run's other
  tokens (``[IMG_BREAK]``, ``<row_1_col_1>``) keep their text embeddings.
- Videos the same way through ``get_video_features``, where the model has it (the clip decoded and
  sampled once by ``pipeline.media``, its frames given to the processor without a second sampling);
  audio clips through ``get_audio_features`` (resampled once to the feature extractor's rate).
- Positions are plain 1-D (shifted as the model's own ``prepare_inputs_for_generation`` shifts
  them: PaliGemma's count from 1), or, where the model has a ``get_rope_index`` taking ids, token
  types and grids (GLM-4V; M-RoPE), its three rows after the text row, their offset after the media
  kept for decoding. Attention is causal, plus the spans the model's own ``create_masks_for_generate``
  attends both ways from ``token_type_ids`` (PaliGemma's prompt; ``model_rules``): their cache keys
  carry the whole span's digest, so the prefix cache reuses a span whole or not at all.
- Models this family cannot run are refused before their weights load (``REFUSED`` and
  ``refusal``): cross-attention to the image, encoder-decoders, images as discrete tokens, per-layer
  inputs; and, read off the config and the transformers class, deepstack features (Qwen3-VL-MoE),
  ``token_type_ids`` the model's mask builder does not take, a ``get_rope_index`` that wants other
  inputs, and text layers the KV pool cannot page.

Families with knowledge this one lacks keep their own plug-ins (Qwen2-VL's 3-D positions, Qwen3-VL's
deepstack features, Qwen2-Audio's long clips split at the encoder window, the Omni models' audio inside
video). Gemma 3 keeps its family too, though this one's mask rule reads the same image blocks off its
model (a test checks it): not folded yet.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable, Sequence

import torch

from pipeline.errors import UserError
from pipeline.families.base import Family, media_keys, media_name, prompt_embeds
from pipeline.families.model_rules import attention_blocks, position_offset, takes_token_types
from pipeline.families.qwen2_audio import waveform
from pipeline.families.qwen2_vl import load_images, load_videos
from pipeline.media import Video, content_hash
from pipeline.memory import ATTENTION_KINDS, layer_kinds

if TYPE_CHECKING:
    from pipeline.context import Context

TEXT_KEYS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}
ROPE_DELTAS = "rope_deltas"  # KVCache.state key: M-RoPE's offset after the media, for decode positions
BLOCKS = "vision_blocks"  # ctx.model_inputs key: the prompt's spans attended both ways (token_type_ids models)


@dataclass(frozen=True)
class Kind:
    """What differs between images and videos on this surface: the slot token's config names, the
    processor's placeholder attribute and argument, the model's features method."""

    name: str
    token_names: tuple[str, ...]
    marker: str
    argument: str
    features: str
    towers: tuple[str, ...]  # module names its encoder goes by in transformers' models

    def key(self, what: str) -> str:
        """A ``ctx.model_inputs`` key of this kind: its per-item ``inputs``, ``slots`` or ``hashes``."""
        return f"vision_{self.name}_{what}"


VISION_TOWERS = (
    "vision_tower",
    "multi_modal_projector",
    "vision_model",
    "connector",
    "mlp1",
    "vision_projection",
    "visual",
    "image_newline",
    "vision_tokenizer",
)
AUDIO_TOWERS = ("audio_tower", "audio_model", "audio_encoder", "audio_tokenizer", "audio_projector")
IMAGE = Kind(
    "image", ("image_token_id", "image_token_index"), "image_token", "images", "get_image_features", VISION_TOWERS
)
VIDEO = Kind(
    "video", ("video_token_id", "video_token_index"), "video_token", "videos", "get_video_features", VISION_TOWERS
)
AUDIO = Kind(
    "audio", ("audio_token_id", "audio_token_index"), "audio_token", "audio", "get_audio_features", AUDIO_TOWERS
)

# model_type -> why it cannot run here (checked before the weights load).
REFUSED = {
    "mllama": "its layers cross-attend to the image (the paged KV cache holds self-attention only)",
    "florence2": "it is an encoder-decoder model (the engine runs decoder-only models)",
    "vision-encoder-decoder": "it is an encoder-decoder model (the engine runs decoder-only models)",
    "pix2struct": "it is an encoder-decoder model (the engine runs decoder-only models)",
    "udop": "it is an encoder-decoder model (the engine runs decoder-only models)",
    "t5gemma2": "it is an encoder-decoder model (the engine runs decoder-only models)",
    "chameleon": "it reads images as discrete VQ tokens, not embeddings",
    "emu3": "it reads images as discrete VQ tokens, not embeddings",
    "janus": "it reads images as discrete VQ tokens, not embeddings",
    "gemma3n": "its decoder takes per-layer inputs besides the token embeddings",
    "idefics": "its layers cross-attend to the image (the paged KV cache holds self-attention only)",
}


# Checked token for token against generate() by tests/test_generic_vision.py (tiny checkpoints built with
# each architecture's own config, model and processor classes): what ``--list-models`` calls tested.
TESTED = (
    "llava",
    "llava_next",
    "llava_next_video",
    "llava_onevision",
    "vipllava",
    "mistral3",
    "idefics2",
    "idefics3",
    "internvl",
    "aya_vision",
    "cohere2_vision",
    "glm4v",
    "paligemma",
    "smolvlm",
    "apertus1p5",
)


class VisionFamily(Family):
    """The generic image-text-to-text family (see the module docstring); videos too where the model
    has ``get_video_features``."""

    name = "vision"
    model_types: tuple[str, ...] = ()  # chosen by ``families.family_for_config`` for mapped types no family claims
    auto_class = "AutoModelForImageTextToText"
    media: tuple[str, ...] = ("image",)
    # Vision and audio towers and projectors under the names transformers' models give them.
    encoder_modules = VISION_TOWERS + AUDIO_TOWERS
    uses_processor = True

    def __init__(self, config: Any = None) -> None:
        cls = model_class(config) if config is not None else None
        if cls is not None:
            self.media = tuple(kind.name for kind in (IMAGE, VIDEO, AUDIO) if hasattr(cls, kind.features))
        # M-RoPE: the model's own get_rope_index gives 3 rows; the text position goes first (4 rows, as
        # transformers' text models take them).
        self.rope = cls is not None and rope_index_class(cls) is not None
        if self.rope:
            self.position_rows = 4
        self.token_types = cls is not None and takes_token_types(cls)  # PaliGemma: its prefix seen both ways
        self.offset: int | None = None  # where positions start, asked of the model on first use

    # --- tokenize ---------------------------------------------------------------------------
    def prepare(self, lm: Any, request: Any, long_audio: str = "split") -> Any:
        """Video paths decoded and sampled once, here (every later stage reads the same clips); audio as
        ``(wave, rate)`` at the feature extractor's rate."""
        if request.videos and not all(isinstance(v, Video) for v in request.videos):
            request = dataclasses.replace(request, videos=load_videos(list(request.videos)))
        if request.audios:
            rate = self.audio_rate(lm)
            request = dataclasses.replace(
                request, audios=[(waveform(a, rate, i)[0], rate) for i, a in enumerate(request.audios)]
            )
        return request

    def process(self, lm: Any, text: str, request: Any) -> dict:
        """The processor's outputs for the whole prompt (ids; the spans its mask attends both ways), and
        per image, video and audio clip its own inputs, slot count and content hash, from the processor
        run on it alone."""
        items = {
            IMAGE: load_images(list(request.images)),
            VIDEO: load_videos(list(request.videos)),
            AUDIO: list(request.audios),
        }
        bos = lm.tokenizer.bos_token
        # As the processor's apply_chat_template: a template that wrote the BOS, the tokenizer must not.
        kwargs = {"add_special_tokens": False} if bos and text.startswith(bos) else {}
        media = {k: v for kind, found in items.items() for k, v in _media_args(kind, found).items()}
        out = dict(self._run_processor(lm, [text], request, **media, **kwargs))
        for kind, found in items.items():
            if not found:
                continue
            slot = slot_id(lm, kind)
            alone = [
                self._run_processor(
                    lm, [marker(lm, kind)], request, add_special_tokens=False, **_media_args(kind, [item])
                )
                for item in found
            ]
            counts = [int((a["input_ids"] == slot).sum()) for a in alone]
            if 0 in counts:
                article = "an" if kind.name[0] in "aeiou" else "a"
                raise UserError(
                    f"{lm.path}: its processor writes no {kind.name} slot for {article} {kind.name} (it "
                    f"expands it into other tokens): the generic vision family cannot place its {kind.name}s"
                )
            placed = int((out["input_ids"] == slot).sum())
            if placed != sum(counts):
                raise UserError(
                    f"the prompt has {placed} {kind.name} slots but its {len(found)} {kind.name}(s) fill "
                    f"{sum(counts)}: the chat template wrote a different number of placeholders"
                )
            out[kind.key("inputs")] = [{k: v for k, v in a.items() if k not in TEXT_KEYS} for a in alone]
            out[kind.key("slots")] = counts
            out[kind.key("hashes")] = [content_hash(_first_tensor(v)) for v in out[kind.key("inputs")]]
        for key in [
            k for k in out if k not in TEXT_KEYS and not k.startswith("vision_") and not k.endswith("_grid_thw")
        ]:
            del out[key]  # the whole prompt's pixels: the per-item inputs above are what is encoded (grids: positions)
        types = out.get("token_type_ids")
        out[BLOCKS] = attention_blocks(lm.model, types) if self.token_types and types is not None else []
        return out

    @staticmethod
    def _run_processor(lm: Any, text: list[str], request: Any, **kwargs: Any) -> dict:
        try:
            return lm.processor(text=text, return_tensors="pt", **kwargs)
        except ValueError as err:
            names = ", ".join(
                [media_name(src, "image", i) for i, src in enumerate(request.images)]
                + [media_name(src, "video", i) for i, src in enumerate(request.videos)]
                + [media_name(src, "audio", i) for i, src in enumerate(request.audios)]
            )
            reason = " ".join(str(err).split())
            raise UserError(f"{names or 'the prompt'}: {type(lm.processor).__name__} refused it: {reason}") from None

    def token_keys(self, ctx: "Context") -> list[Hashable]:
        """Token ids, except over each image's, video's and clip's run: ``(id, content hash, index)``; inside a
        span attended both ways each key also carries the whole span's digest (a token's KV there depends
        on the tokens after it: a prompt sharing only the span's start must not reuse it)."""
        spans = [span for kind in (IMAGE, VIDEO, AUDIO) for span in _spans(ctx, kind)]
        hashes = [h for kind in (IMAGE, VIDEO, AUDIO) for h in ctx.model_inputs.get(kind.key("hashes")) or []]
        keys = media_keys(ctx.input_ids[0].tolist(), spans, hashes)
        for start, end in self.bidirectional_spans(ctx):
            digest = hashlib.sha256(repr(keys[start:end]).encode()).hexdigest()
            keys[start:end] = [(key, digest) for key in keys[start:end]]
        return keys

    def bidirectional_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        """The spans the model's own prefill mask attends both ways (from ``token_type_ids``)."""
        return list(ctx.model_inputs.get(BLOCKS) or [])

    # --- positions ----------------------------------------------------------------------------
    def prompt_positions(self, ctx: "Context", start: int) -> torch.Tensor:
        """Plain positions; with M-RoPE [4, 1, L - start]: the text row, then ``get_rope_index``'s three
        (their offset after the media, ``rope_deltas``, kept in the cache state for decoding)."""
        if not self.rope:
            return super().prompt_positions(ctx, start) + self._offset(ctx)
        ids = ctx.input_ids
        length = ids.shape[1]
        text = torch.arange(length, device=ids.device).view(1, 1, -1)
        types = torch.zeros_like(ids, dtype=torch.int32)  # text 0, image 1, video 2 (transformers' convention)
        for value, kind in ((1, IMAGE), (2, VIDEO)):
            if ctx.model_inputs.get(kind.key("slots")):
                types[ids == slot_id(ctx.lm, kind)] = value
        grids = {k: v.to(ids.device) for k, v in ctx.model_inputs.items() if k.endswith("_grid_thw") and v is not None}
        if grids and bool(types.any()):
            rope, deltas = _rope_model(ctx.lm.model).get_rope_index(ids, mm_token_type_ids=types, **grids)
            rope, delta = rope.to(ids.device), int(deltas.view(-1)[0])
        else:
            rope, delta = text.expand(3, 1, length), 0
        ctx.cache.state[ROPE_DELTAS] = delta
        return torch.cat([text, rope], dim=0)[..., start:]

    def decode_positions(self, ctx: "Context", position: int) -> torch.Tensor:
        """With M-RoPE [4, 1, 1]: the text position, then three copies of it plus ``rope_deltas``."""
        if not self.rope:
            return super().decode_positions(ctx, position) + self._offset(ctx)
        delta = int(ctx.cache.state.get(ROPE_DELTAS, 0))
        return torch.tensor([position] + [position + delta] * 3, device=ctx.input_ids.device).view(4, 1, 1)

    def _offset(self, ctx: "Context") -> int:
        if self.offset is None:
            self.offset = position_offset(ctx.lm.model)
        return self.offset

    # --- what the vision stage asks ----------------------------------------------------------
    def image_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        return _spans(ctx, IMAGE)

    def video_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        return _spans(ctx, VIDEO)

    def encode_images(self, ctx: "Context", items: list[int]) -> tuple[torch.Tensor, float]:
        return _encode(ctx, IMAGE, items)

    def encode_videos(self, ctx: "Context", items: list[int]) -> tuple[torch.Tensor, float]:
        return _encode(ctx, VIDEO, items)

    def audio_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        return _spans(ctx, AUDIO)

    def encode_audios(self, ctx: "Context", items: list[int]) -> torch.Tensor:
        """The runs of clips ``items`` through ``get_audio_features`` (the AudioEncoder stage asks)."""
        return _encode(ctx, AUDIO, items)[0]


def _media_args(kind: Kind, found: list) -> dict:
    """The processor's keyword arguments for these items of one kind: clips as their sampled frames
    (no second sampling), with their timing."""
    if not found:
        return {}
    if kind is VIDEO:
        return {
            "videos": [v.frames for v in found],
            "video_metadata": [v.metadata() for v in found],
            "do_sample_frames": False,
        }
    if kind is AUDIO:  # (wave, rate) pairs, all at the feature extractor's rate (prepare)
        return {"audio": [wave.numpy() for wave, _ in found], "sampling_rate": found[0][1]}
    return {kind.argument: found}


def _spans(ctx: "Context", kind: Kind) -> list[tuple[int, int]]:
    """[start, end) of each item's run: from its first slot to its last."""
    counts = ctx.model_inputs.get(kind.key("slots")) or []
    if not counts:
        return []
    slots = (ctx.input_ids[0] == slot_id(ctx.lm, kind)).nonzero().view(-1).tolist()
    spans, k = [], 0
    for n in counts:
        spans.append((slots[k], slots[k + n - 1] + 1))
        k += n
    return spans


def _encode(ctx: "Context", kind: Kind, items: list[int]) -> tuple[torch.Tensor, float]:
    """Each run of ``items`` as rows (concatenated): the item's embeddings in its slots, the
    prompt's own embeddings elsewhere in the run; and the megapixels the tower saw."""
    lm = ctx.lm
    slot = slot_id(lm, kind)
    ids = ctx.input_ids[0]
    current = prompt_embeds(ctx)[0]
    spans = _spans(ctx, kind)
    rows, megapixels = [], 0.0
    for k in items:
        inputs = ctx.model_inputs[kind.key("inputs")][k]
        try:
            features = media_features(lm.model, kind, inputs)
        except (RuntimeError, ValueError, IndexError) as err:  # e.g. Mistral 3 on an image under one merged patch
            name = media_name(getattr(ctx.request, f"{kind.name}s")[k], kind.name, k)
            reason = " ".join(str(err).split())[:300]
            raise UserError(
                f"{name}: {type(lm.model).__name__}.{kind.features} could not encode it: {reason}"
            ) from None
        start, end = spans[k]
        run = current[start:end].clone()
        where = (ids[start:end] == slot).to(run.device)
        if int(where.sum()) != features.shape[0]:
            raise ValueError(f"{kind.name} {k + 1}: {int(where.sum())} slots but {features.shape[0]} embeddings")
        run[where] = features.to(run.device, run.dtype)
        rows.append(run)
        megapixels += _megapixels(lm, inputs)
    return torch.cat(rows), megapixels


def _megapixels(lm: Any, inputs: dict) -> float:
    """Pixels one item's inputs hold: [..., channels, height, width] tensors, or flattened patches
    counted by their grid (``*_grid_thw``: patches of the processor's ``patch_size``)."""
    pixels = _first_tensor(inputs)
    if pixels.dim() >= 3:
        return pixels.numel() / pixels.shape[-3] / 1e6
    grid = next((v for k, v in inputs.items() if k.endswith("_grid_thw")), None)
    side = getattr(getattr(lm.processor, "image_processor", None), "patch_size", None)
    if grid is None or not isinstance(side, int):
        return 0.0
    return float(grid.prod(dim=-1).sum()) * side * side / 1e6


def slot_id(lm: Any, kind: Kind = IMAGE) -> int:
    """The id of one of ``kind``'s slots: the config's, else the processor's."""
    for name in kind.token_names:
        value = getattr(lm.config, name, None)
        if value is not None:
            return int(value)
    value = getattr(lm.processor, f"{kind.name}_token_id", None)
    if value is None:
        raise UserError(f"{lm.path}: neither its config nor its processor names the {kind.name} token")
    return int(value)


def marker(lm: Any, kind: Kind = IMAGE) -> str:
    """The placeholder text a prompt holds for one item of ``kind``, before the processor expands it."""
    text = getattr(lm.processor, kind.marker, None) or getattr(lm.tokenizer, kind.marker, None)
    if not text:
        raise UserError(f"{lm.path}: its processor names no {kind.name} token")
    return str(text)


def media_features(model: torch.nn.Module, kind: Kind, inputs: dict) -> torch.Tensor:
    """One item's embeddings [slots, hidden] from ``get_image_features`` / ``get_video_features`` /
    ``get_audio_features`` (its processor inputs on the tower's device, floats in its dtype; only the inputs
    the method takes)."""
    tower = next(m for name in kind.towers if (m := _find(model, name)) is not None)
    param = next(tower.parameters())
    method = getattr(model, kind.features)
    params = inspect.signature(method).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    args = {}
    for key, value in inputs.items():
        if key in params or (open_kwargs and key.startswith(("pixel_", "image_", "video_", "audio_", "input_"))):
            if isinstance(value, torch.Tensor):
                value = value.to(param.device, param.dtype if value.is_floating_point() else None)
            args[key] = value
    out = method(**args)
    pooled = getattr(out, "pooler_output", None)
    out = pooled if pooled is not None else out[0] if hasattr(out, "to_tuple") else out
    parts: Sequence[torch.Tensor] = out if isinstance(out, (list, tuple)) else [out]
    return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])


def _find(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    for path, module in model.named_modules():
        if path == name or path.endswith("." + name):
            return module
    return None


def _first_tensor(inputs: dict) -> torch.Tensor:
    return next(v for v in inputs.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


def claims(config: Any) -> bool:
    """Whether this family is the one for ``config``: transformers maps its type to an
    image-text-to-text class (or this module refuses the type by name)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    model_type = getattr(config, "model_type", "")
    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or model_type in REFUSED


def model_class(config: Any) -> type | None:
    """The transformers class ``AutoModelForImageTextToText`` loads for ``config`` (None: unmapped)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(
        transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(getattr(config, "model_type", ""), ""), None
    )


def rope_index_class(cls: type) -> type | None:
    """The class in ``cls``'s module whose ``get_rope_index`` this family calls: one taking the ids,
    ``mm_token_type_ids`` and the ``*_grid_thw`` grids (GLM-4V's and the Qwen models' shape), or None."""
    module = inspect.getmodule(cls)
    for c in vars(module).values():
        method = getattr(c, "get_rope_index", None) if isinstance(c, type) else None
        if method is None:
            continue
        params = set(inspect.signature(method).parameters) - {"self", "kwargs", "attention_mask"}
        if "mm_token_type_ids" in params and params <= {
            "input_ids",
            "mm_token_type_ids",
            "image_grid_thw",
            "video_grid_thw",
        }:
            return c
    return None


def _rope_model(model: torch.nn.Module) -> Any:
    """The module of ``model`` that has ``get_rope_index`` (the inner model, or the model itself)."""
    return model.model if hasattr(getattr(model, "model", None), "get_rope_index") else model


def refusal(config: Any) -> str | None:
    """Why an image-text-to-text model cannot run through this family (None: it can)."""
    model_type = getattr(config, "model_type", "")
    if model_type in REFUSED:
        return REFUSED[model_type]
    if getattr(getattr(config, "vision_config", None), "deepstack_visual_indexes", None):
        return (
            "its vision features are also added inside the decoder (deepstack), which only the qwen3-vl family applies"
        )
    cls = model_class(config)
    if cls is None or not hasattr(cls, "get_image_features"):
        return "its transformers class has no get_image_features (the surface this family runs models through)"
    if "token_type_ids" in inspect.signature(cls.forward).parameters and not takes_token_types(cls):
        return (
            "its attention depends on token_type_ids in a way its create_masks_for_generate does not say "
            "(the generic family reads image or prefix blocks attended both ways from it)"
        )
    module = inspect.getmodule(cls)
    if rope_index_class(cls) is None and any(
        isinstance(c, type) and hasattr(c, "get_rope_index") for c in vars(module).values()
    ):
        return "its get_rope_index (M-RoPE positions) takes other inputs than ids, token types and grids"
    other = set(layer_kinds(config)) - ATTENTION_KINDS
    if other:
        return (
            f"its language model has {', '.join(sorted(other))} layers; the paged KV cache holds full and "
            "sliding-window attention"
        )
    return None
