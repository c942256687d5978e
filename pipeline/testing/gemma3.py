"""Gemma 3 (google/gemma-3-4b-it's layout): SigLIP vision tower, avg-pooled soft tokens, and a
decoder whose layers alternate sliding-window and full attention.

Why these sizes: the window (8 tokens) is shorter than every prompt and than an image block (16
soft tokens), so tests cross the window in prefill and decode, and the bidirectional image
block is cut by it in the sliding layers (the AND of window and block that transformers builds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pipeline.testing.common import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INIT_RANGE,
    INTERMEDIATE,
    KV_HEADS,
    VISION_DEPTH,
    VISION_DIM,
    VISION_HEADS,
    _vocab_size,
)

# transformers' config, model and processor classes are imported in the functions that use them: each
# pulls in its family's modeling code, and ``import pipeline`` imports every family module (the registry).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

FAMILY = "gemma3"
RANK = 5
ROLES: dict[str, Any] = {
    "bos": "<bos>",
    "eos": "<eos>",
    "pad": "<pad>",
    "config_bos": "<bos>",
    "gen_eos": ["<eos>", "<end_of_turn>"],
}
# In the published order (ids 0-5, 105, 106, 255999, 256000, 262144 there; consecutive here).
SPECIAL_TOKENS = [
    (t, True)
    for t in (
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<mask>",
        "[multimodal]",
        "<start_of_turn>",
        "<end_of_turn>",
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    )
]
# Named special tokens beyond bos/eos/pad; Gemma3Processor reads tokenizer.boi_token, .image_token, .eoi_token.
NAMED_TOKENS = {
    "unk_token": "<unk>",
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}

# The published gemma-3-4b-it template.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
CHAT_TEMPLATE = GEMMA3_CHAT_TEMPLATE

SLIDING_WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"]
IMAGE_SIZE = 128  # 8 x 8 patches of 16 px, average-pooled 2 x 2 into 16 soft tokens
PATCH = 16
TOKENS_PER_IMAGE = 16


def text_config(tok: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The language model's config (also what a text-only ``Gemma3ForCausalLM`` takes)."""
    roles, ids = ROLES, tok.convert_tokens_to_ids
    return dict(
        model_type="gemma3_text",
        vocab_size=_vocab_size(tok),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=SLIDING_WINDOW,
        layer_types=list(LAYER_TYPES),
        max_position_embeddings=131072,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        initializer_range=INIT_RANGE,
        rms_norm_eps=1e-6,
        bos_token_id=ids(roles["config_bos"]),
        eos_token_id=ids(roles["eos"]),
        pad_token_id=ids(roles["pad"]),
        tie_word_embeddings=False,
    )


def make_config(tok: PreTrainedTokenizerBase) -> PretrainedConfig:
    """A 3-layer Gemma 3 (two sliding layers, one full) behind a 2-layer SigLIP tower."""
    from transformers import Gemma3Config

    ids = tok.convert_tokens_to_ids
    return Gemma3Config(
        text_config=text_config(tok),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=VISION_DIM,
            intermediate_size=2 * VISION_DIM,
            num_hidden_layers=VISION_DEPTH,
            num_attention_heads=VISION_HEADS,
            image_size=IMAGE_SIZE,
            patch_size=PATCH,
            layer_norm_eps=1e-6,
            vision_use_head=False,
        ),
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
    )


def _with_live_projector(config: PretrainedConfig) -> PreTrainedModel:
    """``Gemma3ForConditionalGeneration`` whose projector is random: transformers initialises it
    to zeros (every image would then look the same to the decoder). Runs under the builder's seed."""
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, INIT_RANGE)
    return model


def model_class() -> Any:
    """What builds the model from its config (saved as ``Gemma3ForConditionalGeneration``)."""
    return _with_live_projector


def make_processor(tok: PreTrainedTokenizerBase) -> ProcessorMixin:
    """The real ``Gemma3Processor`` + ``Gemma3ImageProcessor`` around ``tok``."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    # As published: the pan-and-scan settings unset, so the processor's defaults (off) apply.
    image_processor = Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return Gemma3Processor(
        image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE, image_seq_length=TOKENS_PER_IMAGE
    )
