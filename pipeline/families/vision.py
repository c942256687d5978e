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
- Positions are plain 1-D, attention causal. Models this family cannot run are refused before their
  weights load (``REFUSED`` and ``refusal``): cross-attention to the image, encoder-decoders, images
  as discrete tokens, per-layer inputs; and, read off the transformers class, attention that
  depends on ``token_type_ids`` (PaliGemma's prefix) and positions from ``get_rope_index`` (GLM-4V's
  M-RoPE), which a family of their own would have to compute.

Families with knowledge this one lacks keep their own plug-ins (Qwen2-VL's 3-D positions, Qwen3-VL's
deepstack features, Gemma 3's bidirectional image blocks, the Omni and audio models).
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Hashable, Sequence

import torch

from pipeline.errors import UserError
from pipeline.families.base import Family, media_keys, media_name, prompt_embeds
from pipeline.families.qwen2_vl import load_images
from pipeline.media import content_hash
from pipeline.memory import ATTENTION_KINDS, layer_kinds

if TYPE_CHECKING:
    from pipeline.context import Context

IMAGES = "vision_images"  # ctx.model_inputs key: per image, its own vision inputs (processor output)
COUNTS = "vision_image_slots"  # per image, how many image-token slots it fills
HASHES = "vision_image_hashes"  # per image, a content hash of its vision inputs
TEXT_KEYS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}

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
TESTED = ("llava", "llava_next", "llava_next_video", "llava_onevision", "vipllava", "mistral3", "idefics3",
          "internvl", "aya_vision", "cohere2_vision")


class VisionFamily(Family):
    """The generic image-text-to-text family (see the module docstring)."""

    name = "vision"
    model_types: tuple[str, ...] = ()  # chosen by ``families.family_for_config`` for mapped types no family claims
    auto_class = "AutoModelForImageTextToText"
    media = ("image",)
    # Vision towers and projectors under the names transformers' models give them.
    encoder_modules = ("vision_tower", "multi_modal_projector", "vision_model", "connector", "mlp1",
                       "vision_projection", "visual", "image_newline")
    uses_processor = True

    # --- tokenize ---------------------------------------------------------------------------
    def process(self, lm: Any, text: str, request: Any) -> dict:
        images = load_images(list(request.images))
        bos = lm.tokenizer.bos_token
        # As the processor's apply_chat_template: a template that wrote the BOS, the tokenizer must not.
        kwargs = {"add_special_tokens": False} if bos and text.startswith(bos) else {}
        out = dict(self._run_processor(lm, [text], images, request, **kwargs))
        slot = image_token_id(lm)
        alone = [self._run_processor(lm, [image_marker(lm)], [image], request, add_special_tokens=False)
                 for image in images]
        counts = [int((a["input_ids"] == slot).sum()) for a in alone]
        found = int((out["input_ids"] == slot).sum())
        if found != sum(counts):
            raise UserError(f"the prompt has {found} image slots but its {len(images)} image(s) fill {sum(counts)}: "
                            "the chat template wrote a different number of image placeholders")
        out[IMAGES] = [{k: v for k, v in a.items() if k not in TEXT_KEYS} for a in alone]
        out[COUNTS] = counts
        out[HASHES] = [content_hash(_first_tensor(v)) for v in out[IMAGES]]
        for key in [k for k in out if k not in TEXT_KEYS and k not in (IMAGES, COUNTS, HASHES)]:
            del out[key]  # the whole prompt's pixels: the per-image inputs above are what is encoded
        return out

    @staticmethod
    def _run_processor(lm: Any, text: list[str], images: list, request: Any, **kwargs: Any) -> dict:
        try:
            return lm.processor(text=text, images=images or None, return_tensors="pt", **kwargs)
        except ValueError as err:
            names = ", ".join(media_name(src, "image", i) for i, src in enumerate(request.images))
            reason = " ".join(str(err).split())
            raise UserError(f"{names or 'the prompt'}: {type(lm.processor).__name__} refused it: {reason}") from None

    def token_keys(self, ctx: "Context") -> list[Hashable]:
        """Token ids, except over each image's run: ``(id, content hash, index)``."""
        return media_keys(ctx.input_ids[0].tolist(), self.image_spans(ctx), ctx.model_inputs.get(HASHES) or [])

    # --- what the vision stage asks ----------------------------------------------------------
    def image_spans(self, ctx: "Context") -> list[tuple[int, int]]:
        """[start, end) of each image's run: from its first image slot to its last."""
        counts = ctx.model_inputs.get(COUNTS) or []
        slots = (ctx.input_ids[0] == image_token_id(ctx.lm)).nonzero().view(-1).tolist()
        spans, k = [], 0
        for n in counts:
            spans.append((slots[k], slots[k + n - 1] + 1))
            k += n
        return spans

    def encode_images(self, ctx: "Context", items: list[int]) -> tuple[torch.Tensor, float]:
        """Each run of ``items`` as rows (concatenated): the image's embeddings in its image slots,
        the prompt's own embeddings elsewhere in the run; and the megapixels the tower saw."""
        lm = ctx.lm
        slot = image_token_id(lm)
        ids = ctx.input_ids[0]
        current = prompt_embeds(ctx)[0]
        spans = self.image_spans(ctx)
        rows, megapixels = [], 0.0
        for k in items:
            inputs = ctx.model_inputs[IMAGES][k]
            features = image_features(lm.model, inputs)
            start, end = spans[k]
            run = current[start:end].clone()
            where = (ids[start:end] == slot).to(run.device)
            if int(where.sum()) != features.shape[0]:
                raise ValueError(f"image {k + 1}: {int(where.sum())} image slots but {features.shape[0]} embeddings")
            run[where] = features.to(run.device, run.dtype)
            rows.append(run)
            pixels = _first_tensor(inputs)  # [..., channels, height, width]
            megapixels += pixels.numel() / pixels.shape[-3] / 1e6
        return torch.cat(rows), megapixels


def image_token_id(lm: Any) -> int:
    """The id of an image slot: the config's, else the processor's."""
    config = lm.config
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    value = getattr(lm.processor, "image_token_id", None)
    if value is None:
        raise UserError(f"{lm.path}: neither its config nor its processor names the image token")
    return int(value)


def image_marker(lm: Any) -> str:
    """The placeholder text a prompt holds for one image, before the processor expands it."""
    marker = getattr(lm.processor, "image_token", None) or getattr(lm.tokenizer, "image_token", None)
    if not marker:
        raise UserError(f"{lm.path}: its processor names no image token")
    return str(marker)


def image_features(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """One image's embeddings [slots, hidden] from ``get_image_features`` (its processor inputs on
    the tower's device, pixels in its dtype; only the inputs the method takes)."""
    tower = next(m for name in VisionFamily.encoder_modules if (m := _find(model, name)) is not None)
    param = next(tower.parameters())
    params = inspect.signature(model.get_image_features).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    args = {}
    for key, value in inputs.items():
        if key in params or (open_kwargs and key.startswith(("pixel_", "image_"))):
            if isinstance(value, torch.Tensor):
                value = value.to(param.device, param.dtype if value.is_floating_point() else None)
            args[key] = value
    out = model.get_image_features(**args)
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


def refusal(config: Any) -> str | None:
    """Why an image-text-to-text model cannot run through this family (None: it can)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    model_type = getattr(config, "model_type", "")
    if model_type in REFUSED:
        return REFUSED[model_type]
    cls = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type, ""), None)
    if cls is None or not hasattr(cls, "get_image_features"):
        return "its transformers class has no get_image_features (the surface this family runs models through)"
    if "token_type_ids" in inspect.signature(cls.forward).parameters:
        return ("its attention depends on token_type_ids (image or prefix blocks attended both ways), "
                "which only a family of its own applies here (as Gemma 3's does)")
    module = inspect.getmodule(cls)
    if any(isinstance(c, type) and hasattr(c, "get_rope_index") for c in vars(module).values()):
        return "its positions come from get_rope_index (M-RoPE), which only the Qwen families compute here"
    other = set(layer_kinds(config)) - ATTENTION_KINDS
    if other:
        return (f"its language model has {', '.join(sorted(other))} layers; the paged KV cache holds full and "
                "sliding-window attention")
    return None
