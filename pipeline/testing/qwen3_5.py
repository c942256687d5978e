"""Qwen3.5: Qwen3-VL's placeholders, processors and interleaved M-RoPE in front of a hybrid decoder
whose layers are Gated DeltaNet (``linear_attention``: a recurrent state, no per-position keys)
or gated full attention; no deepstack. Qwen3's tokenizer layout (the same special tokens in the
same order), the published Qwen3.5-0.8B template.

Why these sizes: both layer kinds appear twice (``LAYER_TYPES``), so a prompt crosses
linear -> full -> linear -> full and the recurrent state of two layers must survive
between prefill chunks and decode steps; the linear heads are uneven (2 key heads, 4 value
heads), as the larger published checkpoints' are, so the key/value head repeat is exercised.
Every ``nn.Linear`` has ``in_features >= 64``; ``linear_attn.in_proj_a`` / ``in_proj_b`` have one
output per value head (4 here, 16 in the 0.8B model), which bitsandbytes' CPU 4-bit packing
refuses (it needs a multiple of 32): nf4 on CPU must keep them unquantised.

``make_text_config`` is also what the text-only ``Qwen3_5ForCausalLM`` takes
(``pipeline.testing.qwen3_5_text``, family ``qwen3.5-text``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.testing.common import QWEN_ROLES, _text_kwargs
from pipeline.testing.qwen2_vl import _vl_config
from pipeline.testing.qwen3 import SPECIAL_TOKENS as QWEN3_SPECIAL_TOKENS
from pipeline.testing.qwen3 import USER_TURN_AND_REASONING
from pipeline.testing.qwen3_vl import processor_with, tower

# transformers' config, model and processor classes are imported in the functions that use them: each
# pulls in its family's modeling code, and ``import pipeline`` imports every family module (the registry).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

FAMILY = "qwen3.5"
RANK = 8
ROLES = QWEN_ROLES  # eos <|im_end|>, pad <|endoftext|>; generation stops on both, as published
# Qwen3.5's tokenizer numbers its special tokens as Qwen3's does (<|endoftext|> 248044, <|im_start|>
# +1, <|vision_start|> +9, <|image_pad|> +12, <tool_call> +14, <think> +24), <think> and
# <tool_call> added but not special.
SPECIAL_TOKENS = QWEN3_SPECIAL_TOKENS
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
HEAD_DIM = 64  # gated attention; a quarter of it rotates (partial_rotary_factor 0.25, as published)
MROPE_SECTION = [3, 3, 2]  # the 8 rotary frequencies split T/H/W, interleaved (published: [11, 11, 10] of 32)
LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)

# The published Qwen/Qwen3.5-0.8B template (chat_template.jinja): Qwen3-VL's media items, XML
# tool calls, and a generation prompt that does NOT think unless asked (enable_thinking=true):
# the 0.8B model card says it "operates in non-thinking mode by default". Taken from the copy in
# github.com/trymirai/uzu (crates/hanashi/configs/rendering/qwen3.5.json, first version, commit
# f4a421880), as the hub file itself could not be fetched here.
CHAT_TEMPLATE = (
    r"""{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count, is_system_content=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain images.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Picture ' ~ image_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain videos.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Video ' ~ video_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {%- if content %}
            {{- '\n\n' + content }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content, false)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, true)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
"""
    + USER_TURN_AND_REASONING
    + r"""        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}
                        {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- else %}
                        {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- endif %}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is true %}
        {{- '<think>\n' }}
    {%- else %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
)


def make_text_config(tok: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The language model's settings: 4 layers (Gated DeltaNet and gated attention, twice each),
    interleaved M-RoPE on a quarter of each 64-wide head; ids from ``tok``."""
    text = _text_kwargs(tok, FAMILY, ROLES)
    text.pop("max_window_layers")
    rope = {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": list(MROPE_SECTION),
        "mrope_interleaved": True,
    }
    return {
        **text,
        "num_hidden_layers": len(LAYER_TYPES),
        "layer_types": list(LAYER_TYPES),
        "head_dim": HEAD_DIM,
        "rope_parameters": rope,
        **LINEAR,
    }


def make_config(tok: PreTrainedTokenizerBase) -> PretrainedConfig:
    """A 4-layer hybrid Qwen3.5 behind Qwen3-VL's 2-block tower without deepstack (16 px patches merged
    2 x 2); ids from ``tok``."""
    from transformers import Qwen3_5Config

    return _vl_config(Qwen3_5Config, tok, make_text_config(tok), tower())


def model_class() -> type[PreTrainedModel]:
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration


def make_processor(tok: PreTrainedTokenizerBase) -> ProcessorMixin:
    """The real ``Qwen3VLProcessor`` (what transformers maps ``qwen3_5`` to), Qwen3-VL's: Qwen2-VL's image
    processor and Qwen3-VL's video processor at small pixel budgets."""
    return processor_with(tok, CHAT_TEMPLATE)
