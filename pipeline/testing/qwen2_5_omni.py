"""Qwen2.5-Omni thinker: a Whisper-style audio tower and Qwen2.5-VL's windowed vision tower in front
of an M-RoPE Qwen2 decoder (text out; the talker and its speech are not built).

Why its own tokens: Omni renames Qwen2.5-VL's markers (``<|IMAGE|>``, ``<|VIDEO|>``,
``<|vision_bos|>``...) and puts its audio markers where the object/box tokens were, so the ids
follow the published tokenizer; the processor reads them by name (``NAMED_TOKENS``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.testing.common import (
    AUDIO_DIM,
    AUDIO_HEADS,
    AUDIO_LAYERS,
    HIDDEN,
    INIT_RANGE,
    QWEN_BASE_TOKENS,
    QWEN_ROLES,
)
from pipeline.testing.qwen2_5_vl import window_tower
from pipeline.testing.qwen2_vl import _media_processors, _text_config

# transformers' config, model and processor classes are imported in the functions that use them: each
# pulls in its family's modeling code, and ``import pipeline`` imports every family module (the registry).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

FAMILY = "qwen2.5-omni"
RANK = 7
ROLES = QWEN_ROLES
# Qwen2.5-Omni's tokenizer numbers these from <|endoftext|> on (151643...151656).
SPECIAL_TOKENS = QWEN_BASE_TOKENS + [
    (t, True)
    for t in (
        "<|AUDIO|>",
        "<|audio_bos|>",
        "<|audio_eos|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_bos|>",
        "<|vision_eos|>",
        "<|vision_pad|>",
        "<|IMAGE|>",
        "<|VIDEO|>",
    )
]
# What Qwen2_5OmniProcessor reads from the tokenizer (``tok.image_token``...).
NAMED_TOKENS = {
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "audio_token": "<|AUDIO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
WINDOW_S = 30  # the tiny feature extractor's window (the published one's is 300 s): less padding to featurise

# The published Qwen2.5-Omni-3B/7B template.
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "{% if add_audio_id %}Audio {{ audio_count.value }}: {% endif %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_config(tok: PreTrainedTokenizerBase) -> PretrainedConfig:
    """A 2-layer thinker with 2-block vision and audio towers; token ids come from ``tok``."""
    from transformers import Qwen2_5OmniThinkerConfig

    ids = tok.convert_tokens_to_ids
    return Qwen2_5OmniThinkerConfig(
        text_config=_text_config(tok, FAMILY),
        vision_config=window_tower(),  # Qwen2.5-VL's, without its tokens_per_second
        audio_config=dict(
            num_mel_bins=128,
            encoder_layers=AUDIO_LAYERS,
            encoder_attention_heads=AUDIO_HEADS,
            encoder_ffn_dim=2 * AUDIO_DIM,
            d_model=AUDIO_DIM,
            output_dim=HIDDEN,
            n_window=50,
            max_source_positions=1500,
            initializer_range=INIT_RANGE,
        ),
        audio_token_index=ids("<|AUDIO|>"),
        image_token_index=ids("<|IMAGE|>"),
        video_token_index=ids("<|VIDEO|>"),
        audio_start_token_id=ids("<|audio_bos|>"),
        audio_end_token_id=ids("<|audio_eos|>"),
        vision_start_token_id=ids("<|vision_bos|>"),  # read by get_rope_index; the published config has them too
        vision_end_token_id=ids("<|vision_eos|>"),
        position_id_per_seconds=25,
        seconds_per_chunk=2,
        tie_word_embeddings=False,
    )


def model_class() -> type[PreTrainedModel]:
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    return Qwen2_5OmniThinkerForConditionalGeneration


def make_processor(tok: PreTrainedTokenizerBase) -> ProcessorMixin:
    """The real ``Qwen2_5OmniProcessor``: Qwen2-VL image and video processors with small pixel
    budgets and a 128-bin Whisper feature extractor at 16 kHz."""
    from transformers import Qwen2_5OmniProcessor, WhisperFeatureExtractor

    image_processor, video_processor = _media_processors()
    fe = WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=WINDOW_S,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=True,
    )
    return Qwen2_5OmniProcessor(
        image_processor=image_processor,
        video_processor=video_processor,
        feature_extractor=fe,
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
    )
