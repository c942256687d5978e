"""Qwen2-Audio: a Whisper-style audio encoder in front of a Qwen2 decoder."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.testing.common import (
    AUDIO_DIM,
    AUDIO_HEADS,
    AUDIO_LAYERS,
    INIT_RANGE,
    QWEN_BASE_TOKENS,
    QWEN_ROLES,
    _text_kwargs,
)

# transformers' config, model and processor classes are imported in the functions that use them: each
# pulls in its family's modeling code, and ``import pipeline`` imports every family module (the registry).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

FAMILY = "qwen2-audio"
RANK = 4
ROLES = QWEN_ROLES
SPECIAL_TOKENS = QWEN_BASE_TOKENS + [("<|AUDIO|>", True), ("<|audio_bos|>", True), ("<|audio_eos|>", True)]

# The Qwen2-Audio-7B-Instruct template, with transformers' `content['type'] == 'audio'`
# test added so that {"type": "audio", "path": ...} items (no "audio" key) still count.
QWEN2_AUDIO_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content or content['type'] == 'audio' %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_TEMPLATE = QWEN2_AUDIO_CHAT_TEMPLATE


def make_config(tok: PreTrainedTokenizerBase) -> PretrainedConfig:
    """A 2-layer Qwen2 decoder behind a 2-layer audio encoder; token ids come from ``tok``."""
    from transformers import Qwen2AudioConfig

    ids = tok.convert_tokens_to_ids
    text = _text_kwargs(tok, FAMILY, ROLES)
    return Qwen2AudioConfig(
        text_config={
            "model_type": "qwen2",
            **text,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            "use_sliding_window": False,
        },
        audio_config=dict(
            model_type="qwen2_audio_encoder",
            num_mel_bins=128,
            encoder_layers=AUDIO_LAYERS,
            encoder_attention_heads=AUDIO_HEADS,
            encoder_ffn_dim=2 * AUDIO_DIM,
            d_model=AUDIO_DIM,
            max_source_positions=1500,
            scale_embedding=False,
            activation_function="gelu",
            initializer_range=INIT_RANGE,
        ),
        audio_token_index=ids("<|AUDIO|>"),
    )


def model_class() -> type[PreTrainedModel]:
    from transformers import Qwen2AudioForConditionalGeneration

    return Qwen2AudioForConditionalGeneration


def make_processor(tok: PreTrainedTokenizerBase) -> ProcessorMixin:
    """The real ``Qwen2AudioProcessor`` (128-bin Whisper features at 16 kHz) around ``tok``."""
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=30,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=True,
    )
    return Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok, chat_template=CHAT_TEMPLATE)
