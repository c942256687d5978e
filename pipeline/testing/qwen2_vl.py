"""Qwen2-VL: the embedded default's family; also holds what Qwen2.5-VL shares with it.

Why the sharing: both publish the same chat template, placeholder tokens, M-RoPE text
decoder and image/video processors; only the vision tower and the processor class differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.testing.common import (
    HIDDEN,
    INIT_RANGE,
    MAX_PIXELS,
    MIN_PIXELS,
    MROPE_SECTION,
    QWEN_ROLES,
    QWEN_SPECIAL_TOKENS,
    VISION_DEPTH,
    VISION_DIM,
    VISION_HEADS,
    _text_kwargs,
)

# transformers' config, model and processor classes are imported in the functions that use them: each
# pulls in its family's modeling code, and ``import pipeline`` imports every family module (the registry).
if TYPE_CHECKING:
    from transformers import (
        BaseImageProcessor,
        BaseVideoProcessor,
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        ProcessorMixin,
    )

FAMILY = "qwen2-vl"
RANK = 2
ROLES = QWEN_ROLES
SPECIAL_TOKENS = QWEN_SPECIAL_TOKENS

# The published Qwen2-VL-7B-Instruct template (== Qwen2.5-VL-7B-Instruct's).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE


def _text_config(tok: PreTrainedTokenizerBase, family: str) -> dict[str, Any]:
    """The language model's config with M-RoPE (sections over temporal/height/width)."""
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": list(MROPE_SECTION)}
    return {**_text_kwargs(tok, family, ROLES), "rope_parameters": rope, "use_sliding_window": False}


def _vision_token_ids(tok: PreTrainedTokenizerBase) -> dict[str, int]:
    ids = tok.convert_tokens_to_ids
    return dict(
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )


def _media_processors() -> tuple[BaseImageProcessor, BaseVideoProcessor]:
    """Image and video processors with small pixel budgets, so an image is a handful of tokens."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    bounds = dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, temporal_patch_size=2, merge_size=2)
    return Qwen2VLImageProcessor(**bounds), Qwen2VLVideoProcessor(**bounds)


def _vl_config(
    config_class: type[PretrainedConfig], tok: PreTrainedTokenizerBase, text: dict[str, Any], vision: dict[str, Any]
) -> PretrainedConfig:
    """A Qwen vision-language config (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): the decoder's and the
    tower's settings, the placeholder ids from ``tok``, an untied output layer."""
    return config_class(text_config=text, vision_config=vision, **_vision_token_ids(tok), tie_word_embeddings=False)


def _vl_processor(processor_class: type[ProcessorMixin], tok: PreTrainedTokenizerBase) -> ProcessorMixin:
    """The real ``processor_class`` (Qwen2-VL's or Qwen2.5-VL's) around ``tok``, with the small-budget
    image and video processors and the shared template."""
    image_processor, video_processor = _media_processors()
    return processor_class(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )


def make_config(tok: PreTrainedTokenizerBase) -> PretrainedConfig:
    """A 2-layer Qwen2-VL with a 2-block vision tower; token ids come from ``tok``."""
    from transformers import Qwen2VLConfig

    vision = dict(
        depth=VISION_DEPTH,
        embed_dim=VISION_DIM,
        hidden_size=HIDDEN,
        mlp_ratio=2,
        num_heads=VISION_HEADS,
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        initializer_range=INIT_RANGE,
    )
    return _vl_config(Qwen2VLConfig, tok, _text_config(tok, FAMILY), vision)


def model_class() -> type[PreTrainedModel]:
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration


def make_processor(tok: PreTrainedTokenizerBase) -> ProcessorMixin:
    """The real ``Qwen2VLProcessor`` around ``tok``."""
    from transformers import Qwen2VLProcessor

    return _vl_processor(Qwen2VLProcessor, tok)
