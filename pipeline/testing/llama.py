"""Llama 3: text-only; PreTrainedTokenizerFast with a BOS post-processor, as Meta ships it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.testing.common import _text_kwargs

# transformers' config, model and processor classes are imported in the functions that use them: each
# pulls in its family's modeling code, and ``import pipeline`` imports every family module (the registry).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

FAMILY = "llama"
RANK = 1
ROLES = {
    "bos": "<|begin_of_text|>",
    "eos": "<|eot_id|>",
    "pad": "<|finetune_right_pad_id|>",
    "config_bos": "<|begin_of_text|>",
    "gen_eos": ["<|end_of_text|>", "<|eot_id|>"],
}
SPECIAL_TOKENS = [
    (t, True)
    for t in (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    )
]

# The published Meta-Llama-3-8B-Instruct template.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHAT_TEMPLATE = LLAMA3_CHAT_TEMPLATE


def make_config(tok: PreTrainedTokenizerBase) -> PretrainedConfig:
    """A 2-layer Llama whose token ids come from ``tok``."""
    from transformers import LlamaConfig

    text = _text_kwargs(tok, FAMILY, ROLES)
    return LlamaConfig(
        **text, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, attention_bias=False, mlp_bias=False
    )


def model_class() -> type[PreTrainedModel]:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM
