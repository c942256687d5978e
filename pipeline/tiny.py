"""Deterministic tiny models of real Hugging Face families, built offline by the project.

Why: the embedded default model and every test need a model that loads through the real
``from_pretrained(dir)`` path (config, safetensors, tokenizer, processor, chat template)
without downloading anything.  Each family here gets random weights (seeded, so two builds
are byte-identical), a byte-level BPE tokenizer trained on a small embedded corpus, the
family's special tokens and published chat template, and - for the multimodal families - the
real processor classes (Qwen2-VL image/video processors, Whisper feature extractor).

Public API: ``FAMILIES``, ``build_tiny``, ``make_tokenizer``, ``tiny_model_dir``,
``default_model_dir``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "FAMILIES",
    "DEFAULT_FAMILY",
    "RECIPE_VERSION",
    "MARKER_FILE",
    "build_tiny",
    "make_tokenizer",
    "make_processor",
    "tiny_model_dir",
    "default_model_dir",
]

FAMILIES: tuple[str, ...] = ("qwen3", "llama", "qwen2-vl", "qwen2.5-vl", "qwen2-audio")
DEFAULT_FAMILY = "qwen2-vl"
# Bump when anything below changes what gets written (weights, tokenizer, configs): cached
# directories are keyed on it, so a stale cache is never reused.
RECIPE_VERSION = 1
# Written last into every built directory; lets callers recognise a tiny model (e.g. for a
# "random weights, meaningless output" banner) and records how it was made.
MARKER_FILE = "mm_pipeline_tiny.json"

# --------------------------------------------------------------------------------------
# Sizes: tiny but valid.  Every nn.Linear has in_features >= 64 (bitsandbytes' CPU 4-bit
# path fails below that).  A large initializer_range makes logits vary with the prompt so
# greedy decoding is not stuck on one token.
# --------------------------------------------------------------------------------------
HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 32 -> rotary half-dim 16 -> mrope_section [4, 6, 6]
MROPE_SECTION = [4, 6, 6]
INIT_RANGE = 0.15
VISION_DIM = 64
VISION_HEADS = 4
VISION_DEPTH = 2
AUDIO_DIM = 64
AUDIO_HEADS = 4
AUDIO_LAYERS = 2
NUM_MERGES = 400
MIN_PIXELS = 56 * 56
MAX_PIXELS = 224 * 224

# --------------------------------------------------------------------------------------
# Special tokens, in the order the real tokenizers number them.  (token, special?)
# Qwen3 marks <think>/<tool_call> as added but *not* special, as the published one does,
# so decoding with skip_special_tokens keeps them.
# --------------------------------------------------------------------------------------
_QWEN_BASE = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True)]
_QWEN_VISION = [
    (t, True)
    for t in (
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
    )
]
_SPECIAL_TOKENS: dict[str, list[tuple[str, bool]]] = {
    "qwen3": _QWEN_BASE
    + _QWEN_VISION
    + [
        ("<tool_call>", False),
        ("</tool_call>", False),
        ("<tool_response>", False),
        ("</tool_response>", False),
        ("<think>", False),
        ("</think>", False),
    ],
    "llama": [
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
    ],
    "qwen2-vl": _QWEN_BASE + _QWEN_VISION,
    "qwen2.5-vl": _QWEN_BASE + _QWEN_VISION,
    "qwen2-audio": _QWEN_BASE + [("<|AUDIO|>", True), ("<|audio_bos|>", True), ("<|audio_eos|>", True)],
}

# Role tokens per family: (bos, eos, pad, generation-config eos list).
_ROLE_TOKENS: dict[str, dict[str, Any]] = {
    "qwen": {"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "config_bos": "<|endoftext|>",
             "gen_eos": ["<|im_end|>", "<|endoftext|>"]},
    "llama": {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": "<|finetune_right_pad_id|>",
              "config_bos": "<|begin_of_text|>", "gen_eos": ["<|end_of_text|>", "<|eot_id|>"]},
}


def _roles(family: str) -> dict[str, Any]:
    return _ROLE_TOKENS["llama" if family == "llama" else "qwen"]


# --------------------------------------------------------------------------------------
# Chat templates: the published ones (Qwen3-8B, Qwen2-VL-7B-Instruct == Qwen2.5-VL-7B-Instruct,
# Qwen2-Audio-7B-Instruct, Meta-Llama-3-8B-Instruct).
# --------------------------------------------------------------------------------------
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
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
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
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
        {%- if loop.index0 > ns.last_query_index %}
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

LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CHAT_TEMPLATES: dict[str, str] = {
    "qwen3": QWEN3_CHAT_TEMPLATE,
    "llama": LLAMA3_CHAT_TEMPLATE,
    "qwen2-vl": QWEN2_VL_CHAT_TEMPLATE,
    "qwen2.5-vl": QWEN2_VL_CHAT_TEMPLATE,
    "qwen2-audio": QWEN2_AUDIO_CHAT_TEMPLATE,
}

# Pre-tokenizer split patterns of the real tokenizers.
_QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Small English corpus the BPE merges are learned from: ordinary words become a few tokens.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
Describe this image in one sentence. What is in the picture? What do you hear in this sound?
The image shows a red car parked on the street next to a small green house with a white door.
There is a cat sitting on the table and a dog sleeping under the chair in the living room.
Please answer the question with a short and clear sentence. Think step by step before you answer.
The weather today is sunny and warm, with a light wind from the west and a few clouds in the sky.
In the morning the children walk to school, and in the evening they come back home for dinner.
This audio clip contains the sound of a bird singing, a car passing by, and people talking.
The woman is holding a blue umbrella while she waits for the bus at the corner of the road.
A man is playing the guitar on the stage, and the people in the room are listening to the music.
The model reads the text, looks at the image, listens to the audio, and then writes an answer.
Hello! How are you today? I am fine, thank you. What would you like to know about this photo?
The answer is yes. The answer is no. There are three apples, two oranges and one banana on the plate.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in the text, along with dates and times.
You are a helpful assistant. The user asked a question, and the assistant gave a helpful answer.
Here is a summary of the main points: first, the system loads the model; second, it reads the input;
third, it encodes the image and the audio; fourth, it generates the answer one token at a time.
The river flows through the valley between the mountains, and the trees on the hills are green.
She opened the window, looked at the garden, and saw that the flowers were red, yellow and purple.
We can see a large building with many windows, a tall tower, and a bridge over the water.
The train leaves the station at nine o'clock and arrives in the city two hours later.
It's a beautiful day, isn't it? They're going to the park, and we'll meet them there at noon.
Look at the left side of the picture: there is a person wearing a black jacket and a white hat.
On the right side, two children are playing with a ball near the fence, and a dog is running.
The sound is loud at first and then becomes quiet; it could be a door closing or a car engine.
Write a short story about a robot who learns to paint pictures of the sea and the sky.
The first step is to read the question carefully. The next step is to find the important details.
This is a simple test of the tokenizer, the chat template, the processor and the language model.
Good morning, good afternoon, good evening and good night. Thank you very much for your help.
The color of the sky is blue, the grass is green, the sun is yellow, and the night is dark.
People often use computers, phones and cameras to take photos, record videos and listen to songs.
"""


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel pre-tokenizers produce)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _backend_pipeline(family: str):
    """Normalizer / pre-tokenizer / decoder of the family's real tokenizer.json."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    split = _LLAMA3_SPLIT if family == "llama" else _QWEN_SPLIT
    normalizer = None if family == "llama" else normalizers.NFC()
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=family == "llama", use_regex=False),
        ]
    )
    return normalizer, pre, decoders.ByteLevel()


def _train_bpe(words: Counter[str], num_merges: int) -> list[tuple[str, str]]:
    """Deterministic BPE: most frequent pair first, ties broken by the pair itself."""
    seqs = [list(w) for w in sorted(words)]
    counts = [words[w] for w in sorted(words)]
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for i, s in enumerate(seqs):
        for p in zip(s, s[1:]):
            pair_counts[p] += counts[i]
            where[p].add(i)
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges and pair_counts:
        best = min(pair_counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if best[1] < 2:
            break
        a, b = pair = best[0]
        merges.append(pair)
        for i in sorted(where.pop(pair, ())):
            s, c = seqs[i], counts[i]
            for p in zip(s, s[1:]):
                pair_counts[p] -= c
                if pair_counts[p] <= 0:
                    del pair_counts[p]
            out, j = [], 0
            while j < len(s):
                if j + 1 < len(s) and s[j] == a and s[j + 1] == b:
                    out.append(a + b)
                    j += 2
                else:
                    out.append(s[j])
                    j += 1
            seqs[i] = out
            for p in zip(out, out[1:]):
                pair_counts[p] += c
                where[p].add(i)
        pair_counts.pop(pair, None)
    return merges


@lru_cache(maxsize=None)
def _vocab_and_merges(family: str) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    normalizer, pre, _ = _backend_pipeline(family)
    words: Counter[str] = Counter()
    for line in _CORPUS.splitlines(keepends=True):
        text = normalizer.normalize_str(line) if normalizer is not None else line
        words.update(piece for piece, _ in pre.pre_tokenize_str(text))
    merges = _train_bpe(words, NUM_MERGES)
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode()[b] for b in range(256))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return tuple(vocab.items()), tuple(merges)


def make_tokenizer(family: str):
    """Byte-level BPE tokenizer with the family's special tokens and chat template.

    Why: real tokenizers cannot be downloaded here; this one has the same pre-tokenizer,
    special tokens and template as the published one, so prompts render the same way.
    Qwen families get ``Qwen2Tokenizer`` (what their hub configs name), llama gets
    ``PreTrainedTokenizerFast`` (as Llama-3 ships).
    """
    _check_family(family)
    from tokenizers import AddedToken, Tokenizer, processors
    from tokenizers.models import BPE

    vocab_items, merges = _vocab_and_merges(family)
    vocab, merges = dict(vocab_items), list(merges)
    roles = _roles(family)
    specials = _SPECIAL_TOKENS[family]
    # Special tokens get the ids right after the merges, in the published order, whatever
    # order the tokenizer class registers them in.
    for t, _ in specials:
        vocab[t] = len(vocab)
    added = [AddedToken(t, special=s, normalized=False, lstrip=False, rstrip=False, single_word=False)
             for t, s in specials]

    if family == "llama":
        from transformers import PreTrainedTokenizerFast

        normalizer, pre, decoder = _backend_pipeline(family)
        backend = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=True))
        if normalizer is not None:
            backend.normalizer = normalizer
        backend.pre_tokenizer = pre
        backend.decoder = decoder
        backend.add_tokens(added)
        bos = roles["bos"]
        bos_id = backend.token_to_id(bos)
        backend.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, bos_id)],
                ),
            ]
        )
        tok = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=bos,
            eos_token=roles["eos"],
            pad_token=roles["pad"],
            model_max_length=131072,
            clean_up_tokenization_spaces=False,
            model_input_names=["input_ids", "attention_mask"],
        )
    else:
        from transformers import Qwen2Tokenizer

        tok = Qwen2Tokenizer(
            vocab=vocab,
            merges=merges,
            unk_token=None,
            bos_token=None,
            eos_token=roles["eos"],
            pad_token=roles["pad"],
            model_max_length=32768,
            errors="replace",
            split_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )
        # Qwen2Tokenizer registers eos/pad itself; add the rest in the published order.
        tok.add_tokens(added)
    extra = [t for t, s in specials if s and t not in (roles["bos"], roles["eos"], roles["pad"])]
    tok.add_special_tokens({"additional_special_tokens": extra})  # saved as extra_special_tokens
    tok.chat_template = CHAT_TEMPLATES[family]
    _check_ids(tok, family)
    return tok


def _check_ids(tok, family: str) -> None:
    """Special tokens must stay single tokens at fixed ids, in the published order."""
    ids = [tok.convert_tokens_to_ids(t) for t, _ in _SPECIAL_TOKENS[family]]
    base = ids[0]
    if ids != list(range(base, base + len(ids))) or base != len(dict(_vocab_and_merges(family)[0])):
        raise RuntimeError(f"tiny {family} tokenizer: special token ids out of order: {ids}")


# --------------------------------------------------------------------------------------
# Processor
# --------------------------------------------------------------------------------------
def make_processor(family: str, tokenizer=None):
    """The family's real processor around ``tokenizer`` (None for text-only families).

    Why: the pipeline's media stages must see exactly what transformers' processors produce
    (patch grids, placeholder expansion, mel features).  VL image/video processors get small
    pixel budgets so images stay a handful of tokens.
    """
    _check_family(family)
    if family in ("qwen3", "llama"):
        return None
    tokenizer = tokenizer if tokenizer is not None else make_tokenizer(family)
    template = CHAT_TEMPLATES[family]
    if family in ("qwen2-vl", "qwen2.5-vl"):
        from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

        image_processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14,
                                                temporal_patch_size=2, merge_size=2)
        video_processor = Qwen2VLVideoProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14,
                                                temporal_patch_size=2, merge_size=2)
        if family == "qwen2-vl":
            from transformers import Qwen2VLProcessor as cls
        else:
            from transformers import Qwen2_5_VLProcessor as cls
        return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                   chat_template=template)
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30,
                                 n_fft=400, padding_value=0.0, return_attention_mask=True)
    return Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tokenizer, chat_template=template)


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------
def _vocab_size(tok) -> int:
    # Exactly len(tokenizer): a padded vocabulary (as real checkpoints have) would let a
    # random model emit ids that decode to nothing.
    return len(tok)


def _text_kwargs(tok, family: str) -> dict[str, Any]:
    roles = _roles(family)
    ids = tok.convert_tokens_to_ids
    return dict(
        vocab_size=_vocab_size(tok),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        hidden_act="silu",
        max_position_embeddings=32768 if family != "llama" else 8192,
        max_window_layers=LAYERS,
        initializer_range=INIT_RANGE,
        rms_norm_eps=1e-6 if family != "llama" else 1e-5,
        bos_token_id=ids(roles["config_bos"]),
        eos_token_id=ids(roles["eos"]),
        pad_token_id=ids(roles["pad"]),
        tie_word_embeddings=False,
    )


def _make_config(family: str, tok):
    ids = tok.convert_tokens_to_ids
    text = _text_kwargs(tok, family)
    if family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**text, head_dim=HEAD_DIM, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           use_sliding_window=False, attention_bias=False)
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**text, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                           attention_bias=False, mlp_bias=False)
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": list(MROPE_SECTION)}
    if family == "qwen2-vl":
        from transformers import Qwen2VLConfig

        return Qwen2VLConfig(
            text_config={**text, "rope_parameters": rope, "use_sliding_window": False},
            vision_config=dict(depth=VISION_DEPTH, embed_dim=VISION_DIM, hidden_size=HIDDEN, mlp_ratio=2,
                               num_heads=VISION_HEADS, in_channels=3, patch_size=14, spatial_merge_size=2,
                               temporal_patch_size=2, initializer_range=INIT_RANGE),
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
            tie_word_embeddings=False,
        )
    if family == "qwen2.5-vl":
        from transformers import Qwen2_5_VLConfig

        return Qwen2_5_VLConfig(
            text_config={**text, "rope_parameters": rope, "use_sliding_window": False},
            vision_config=dict(depth=VISION_DEPTH, hidden_size=VISION_DIM, intermediate_size=2 * VISION_DIM,
                               out_hidden_size=HIDDEN, num_heads=VISION_HEADS, in_channels=3, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2, window_size=112,
                               fullatt_block_indexes=[VISION_DEPTH - 1], hidden_act="silu",
                               initializer_range=INIT_RANGE),
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
            tie_word_embeddings=False,
        )
    if family == "qwen2-audio":
        from transformers import Qwen2AudioConfig

        return Qwen2AudioConfig(
            text_config={"model_type": "qwen2", **text, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
                         "use_sliding_window": False},
            audio_config=dict(model_type="qwen2_audio_encoder", num_mel_bins=128, encoder_layers=AUDIO_LAYERS,
                              encoder_attention_heads=AUDIO_HEADS, encoder_ffn_dim=2 * AUDIO_DIM, d_model=AUDIO_DIM,
                              max_source_positions=1500, scale_embedding=False, activation_function="gelu",
                              initializer_range=INIT_RANGE),
            audio_token_index=ids("<|AUDIO|>"),
        )
    raise AssertionError(family)


def _model_class(family: str):
    import transformers as tf

    return {
        "qwen3": tf.Qwen3ForCausalLM,
        "llama": tf.LlamaForCausalLM,
        "qwen2-vl": tf.Qwen2VLForConditionalGeneration,
        "qwen2.5-vl": tf.Qwen2_5_VLForConditionalGeneration,
        "qwen2-audio": tf.Qwen2AudioForConditionalGeneration,
    }[family]


def _generation_config(family: str, tok):
    from transformers import GenerationConfig

    roles = _roles(family)
    ids = tok.convert_tokens_to_ids
    return GenerationConfig(
        bos_token_id=ids(roles["config_bos"]),
        eos_token_id=[ids(t) for t in roles["gen_eos"]],
        pad_token_id=ids(roles["pad"]),
        do_sample=False,
    )


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(FAMILIES)}")


def _write(family: str, seed: int, dest: Path) -> None:
    import torch

    tok = make_tokenizer(family)
    config = _make_config(family, tok)
    with _seeded(torch, seed):
        model = _model_class(family)(config)
    model.eval()
    _mute_added_tokens(model, tok)
    model.generation_config = _generation_config(family, tok)
    processor = make_processor(family, tok)
    with _quiet_progress():
        model.save_pretrained(dest, safe_serialization=True)
        (processor if processor is not None else tok).save_pretrained(dest)
    marker = {"family": family, "seed": seed, "recipe_version": RECIPE_VERSION,
              "note": "random weights built by mm-pipeline; outputs are meaningless"}
    (dest / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _mute_added_tokens(model, tok) -> None:
    """Zero the output rows of added tokens (EOS, role and media markers, <think>).

    Why: with random weights any token is a plausible argmax; a greedy run that emitted EOS
    or <|image_pad|> after two steps would make token-count tests depend on the prompt.
    With zero rows their logit is exactly 0 while the best ordinary token's is several
    units above, so greedy never picks them; sampling still can, rarely (about 1% a step
    at temperature 1).  Tests that need an EOS should configure one explicitly.
    """
    import torch

    ids = sorted(set(tok.get_added_vocab().values()))
    with torch.no_grad():
        model.get_output_embeddings().weight[ids] = 0.0


class _quiet_progress:
    """Hide transformers' per-save progress bars (they would land on the CLI's stderr)."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self.hf = hf_logging
        self.was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc):
        if self.was:
            self.hf.enable_progress_bar()


class _seeded:
    """Seed torch's CPU generator for the build and restore the caller's RNG state after."""

    def __init__(self, torch, seed: int):
        self.torch, self.seed = torch, seed

    def __enter__(self):
        self.state = self.torch.random.get_rng_state()
        self.torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        self.torch.random.set_rng_state(self.state)


def build_tiny(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a complete tiny ``family`` model (config, weights, tokenizer/processor) to ``out_dir``.

    Why: gives tests and the embedded default a real ``from_pretrained`` directory.  Weights
    are seeded, so building twice gives byte-identical safetensors.  The directory is built
    next to ``out_dir`` and moved into place with ``os.replace``, so no process ever sees a
    half-written model; an existing ``out_dir`` is replaced.
    """
    _check_family(family)
    out = Path(out_dir).expanduser().absolute()
    _build_into(family, seed, out, keep_existing=False)
    return out


def _build_into(family: str, seed: int, dest: Path, keep_existing: bool) -> None:
    """Build privately next to ``dest``, then move the directory into place with ``os.replace``.

    When ``dest`` already exists (not empty), it is swapped aside and dropped, unless
    ``keep_existing`` and it is a complete build (a concurrent builder won the race).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        _write(family, seed, tmp)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (keep_existing and _is_complete(dest)):
                old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
                os.replace(dest, old / "d")
                os.replace(tmp, dest)
                shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _cache_root() -> Path:
    env = os.environ.get("MM_PIPELINE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mm-pipeline"


def _is_complete(d: Path) -> bool:
    try:
        marker = json.loads((d / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("recipe_version") == RECIPE_VERSION and (d / "model.safetensors").is_file()


def tiny_model_dir(family: str) -> Path:
    """Cached tiny model for ``family`` (built on first use, reused afterwards).

    Lives in ``$MM_PIPELINE_HOME/tiny-<family>-v<N>`` or ``~/.cache/mm-pipeline/...``.
    Concurrent first uses are safe: each builds privately and the first rename wins.
    """
    _check_family(family)
    d = _cache_root() / f"tiny-{family}-v{RECIPE_VERSION}"
    if not _is_complete(d):
        _build_into(family, 0, d, keep_existing=True)  # a broken leftover is replaced
    return d


def default_model_dir() -> Path:
    """The embedded default model (a tiny ``qwen2-vl``), built on first use."""
    return tiny_model_dir(DEFAULT_FAMILY)
