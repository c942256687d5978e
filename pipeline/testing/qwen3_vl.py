"""Qwen3-VL: Qwen3's tokenizer and tokens, the published Qwen3-VL-4B-Instruct template, a vision
tower with deepstack mergers and the real Qwen3-VL processors.

Why deepstack matters for a tiny model: the tower's intermediate features are added to the
first decoder layers' hidden states at image positions, a forward input the paged engine must
carry; ``DEEPSTACK`` feeds both decoder layers so the tests see it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.testing.common import HEAD_DIM, HIDDEN, INIT_RANGE, MAX_PIXELS, MIN_PIXELS, MROPE_SECTION, QWEN_ROLES
from pipeline.testing.common import VISION_DEPTH, VISION_DIM, VISION_HEADS, _text_kwargs
from pipeline.testing.qwen2_vl import _vl_config
from pipeline.testing.qwen3 import SPECIAL_TOKENS as QWEN3_SPECIAL_TOKENS

# transformers' config, model and processor classes are imported in the functions that use them: each
# pulls in its family's modeling code, and ``import pipeline`` imports every family module (the registry).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

FAMILY = "qwen3-vl"
RANK = 6
ROLES = QWEN_ROLES
SPECIAL_TOKENS = QWEN3_SPECIAL_TOKENS  # Qwen3-VL ships Qwen3's tokenizer
PATCH = 16
DEEPSTACK = [0, 1]  # vision blocks whose features go to decoder layers 0 and 1

# The system message's text (its text items, in order), in the tools preamble and without tools.
_SYSTEM_TEXT = (
    "        {%- if messages[0].content is string %}\n"
    "            {{- messages[0].content }}\n"
    "        {%- else %}\n"
    "            {%- for content in messages[0].content %}\n"
    "                {%- if 'text' in content %}\n"
    "                    {{- content.text }}\n"
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
)
# A message's content as the template renders it for a user turn and a tool response alike: a
# string, or its items in order, images and videos as their placeholders.
_CONTENT_WITH_MEDIA = (
    "        {%- if message.content is string %}\n"
    "            {{- message.content }}\n"
    "        {%- else %}\n"
    "            {%- for content in message.content %}\n"
    "                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}\n"
    "                    {%- set image_count.value = image_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|image_pad|><|vision_end|>\n"
    "                {%- elif content.type == 'video' or 'video' in content %}\n"
    "                    {%- set video_count.value = video_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|video_pad|><|vision_end|>\n"
    "                {%- elif 'text' in content %}\n"
    "                    {{- content.text }}\n"
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
)

# The published Qwen3-VL-4B-Instruct template (no default system prompt, no thinking switch).
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n" + _SYSTEM_TEXT + "        {{- '\\n\\n' }}\n"
    "    {%- endif %}\n"
    '    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' }}\n" + _SYSTEM_TEXT + "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set image_count = namespace(value=0) %}\n"
    "{%- set video_count = namespace(value=0) %}\n"
    "{%- for message in messages %}\n"
    '    {%- if message.role == "user" %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n" + _CONTENT_WITH_MEDIA + "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n"
    "        {%- if message.content is string %}\n"
    "            {{- message.content }}\n"
    "        {%- else %}\n"
    "            {%- for content_item in message.content %}\n"
    "                {%- if 'text' in content_item %}\n"
    "                    {{- content_item.text }}\n"
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and message.content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    '                {{- \'<tool_call>\\n{"name": "\' }}\n'
    "                {{- tool_call.name }}\n"
    '                {{- \'", "arguments": \' }}\n'
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n" + _CONTENT_WITH_MEDIA + "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def tower() -> dict[str, Any]:
    """The vision tower (16-pixel patches merged 2 x 2, learned position embeddings) without deepstack:
    Qwen3.5's is this one."""
    return dict(
        depth=VISION_DEPTH,
        hidden_size=VISION_DIM,
        intermediate_size=2 * VISION_DIM,
        num_heads=VISION_HEADS,
        in_channels=3,
        patch_size=PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=HIDDEN,
        num_position_embeddings=64,
        initializer_range=INIT_RANGE,
    )


def make_config(tok: PreTrainedTokenizerBase) -> PretrainedConfig:
    """A 2-layer Qwen3-VL (interleaved M-RoPE) with a 2-block tower and deepstack; ids from ``tok``."""
    from transformers import Qwen3VLConfig

    text = _text_kwargs(tok, FAMILY, ROLES)
    text.pop("max_window_layers")
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": list(MROPE_SECTION), "mrope_interleaved": True}
    text = {**text, "head_dim": HEAD_DIM, "rope_parameters": rope}
    return _vl_config(Qwen3VLConfig, tok, text, {**tower(), "deepstack_visual_indexes": list(DEEPSTACK)})


def model_class() -> type[PreTrainedModel]:
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration


def processor_with(tok: PreTrainedTokenizerBase, chat_template: str) -> ProcessorMixin:
    """The real ``Qwen3VLProcessor`` (Qwen2-VL's image processor, Qwen3-VL's video processor, small
    pixel budgets) around ``tok``, rendering with ``chat_template``: Qwen3.5's processor is this one."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    bounds = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    common = dict(patch_size=PATCH, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=bounds, **common),
        tokenizer=tok,
        video_processor=Qwen3VLVideoProcessor(size=bounds, **common),
        chat_template=chat_template,
    )


def make_processor(tok: PreTrainedTokenizerBase) -> ProcessorMixin:
    """The real ``Qwen3VLProcessor`` (image and video processors with small pixel budgets)."""
    return processor_with(tok, CHAT_TEMPLATE)
