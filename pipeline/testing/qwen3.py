"""Qwen3: text-only; Qwen2Tokenizer with <think>/<tool_call> as added, non-special tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.testing.common import HEAD_DIM, QWEN_ROLES, QWEN_SPECIAL_TOKENS, _text_kwargs

# transformers' config, model and processor classes are imported in the functions that use them: each
# pulls in its family's modeling code, and ``import pipeline`` imports every family module (the registry).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

FAMILY = "qwen3"
RANK = 0  # where it sorts in FAMILIES (test ids, listings)
ROLES = QWEN_ROLES
# Qwen3 marks <think>/<tool_call> as added but *not* special, as the published one does, so
# decoding with skip_special_tokens keeps them.
SPECIAL_TOKENS = QWEN_SPECIAL_TOKENS + [
    (t, False) for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
]

# A user turn, and an assistant turn's reasoning split out of its content (what is before
# ``</think>``) when it comes without ``reasoning_content``: Qwen3.5's template has the same lines.
USER_TURN_AND_REASONING = r"""        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
"""

# The published Qwen3-8B template (thinking, tools).
QWEN3_CHAT_TEMPLATE = (
    r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
"""
    + USER_TURN_AND_REASONING
    + r"""        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
)
CHAT_TEMPLATE = QWEN3_CHAT_TEMPLATE


def make_config(tok: PreTrainedTokenizerBase) -> PretrainedConfig:
    """A 2-layer Qwen3 whose token ids come from ``tok``."""
    from transformers import Qwen3Config

    text = _text_kwargs(tok, FAMILY, ROLES)
    return Qwen3Config(
        **text,
        head_dim=HEAD_DIM,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        use_sliding_window=False,
        attention_bias=False,
    )


def model_class() -> type[PreTrainedModel]:
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM
