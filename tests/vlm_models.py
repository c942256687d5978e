"""Tiny vision-language checkpoints of architectures no family of the project knows, built as a
user's would be: transformers' own config, model and processor classes, saved with
``save_pretrained`` (issue 48: the generic vision family runs them). Random weights, a tiny
byte-level tokenizer (the project's, plus the model's image tokens), a chat template in the
format of each architecture's reference checkpoint (LLaVA's and LLaVA-NeXT's verbatim, the
others reduced to what one user turn renders); images a few patches large.

    build(model_type, dest) -> dest
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

# llava-hf/llava-1.5-7b-hf's chat_template.json
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    initializer_range=0.1,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
TOWER_56 = dict(VISION, image_size=56, patch_size=14)  # a 56-pixel image is 4 x 4 patches


# What the LLaVA-style builders share: a CLIP tower of 2x2 patches (+ CLS), its image sizes, the features
# LLaVA takes from it, LLaVA's processor settings, LLaVA-NeXT's grid of tile shapes.
CLIP_SIZES = dict(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
LLAVA_FEATURES = dict(vision_feature_layer=-2, vision_feature_select_strategy="default")
LLAVA_PROCESSING = dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)
PINPOINTS = [[28, 56], [56, 28], [56, 56]]


def clip_tower():
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(**VISION, image_size=28, patch_size=14, projection_dim=32)


def llava_style(config_class, tok, **settings):
    """A LLaVA-style config: the CLIP tower and a Llama decoder (ids from ``tok``), then the
    architecture's own ``settings`` (its image token, which features it takes)."""
    from transformers import LlamaConfig

    return config_class(vision_config=clip_tower(), text_config=LlamaConfig(**text_config(tok)), **settings)


def llava_processor(tok):
    """LLaVA's processor (CLIP's image processor), as LLaVA and ViP-LLaVA ship it."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    return LlavaProcessor(CLIPImageProcessor(**CLIP_SIZES), tok, **LLAVA_PROCESSING, chat_template=LLAVA_TEMPLATE)


def tokenizer(extra: list[str], named: dict[str, str] | None = None):
    """The project's tiny Llama-3 tokenizer with ``extra`` special tokens added (image tokens) and
    ``named`` ones as attributes (``tok.boi_token``), as a checkpoint's ``extra_special_tokens`` give them."""
    import tempfile

    from transformers import AutoTokenizer

    from pipeline.testing import make_tokenizer

    tok = make_tokenizer("llama")
    tok.add_special_tokens({"additional_special_tokens": extra})
    if named:
        with tempfile.TemporaryDirectory() as folder:
            tok.save_pretrained(folder)
            tok = AutoTokenizer.from_pretrained(folder, extra_special_tokens=named)
    return tok


def text_config(tok, **more) -> dict:
    return dict(
        TEXT,
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **more,
    )


# llava-hf/LLaVA-NeXT-Video-7B-hf's format: LLaVA's, videos rendered after the images
LLAVA_VIDEO_TEMPLATE = LLAVA_TEMPLATE.replace(
    "{# Render all text next #}",
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}"
    "{# Render all text next #}",
)


def llava(dest: Path) -> None:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    tok = tokenizer(["<image>"])
    config = llava_style(LlavaConfig, tok, image_token_id=tok.convert_tokens_to_ids("<image>"), **LLAVA_FEATURES)
    save(LlavaForConditionalGeneration(config), llava_processor(tok), dest)


# mistralai/Mistral-Small-3.1-24B-Instruct-2503's format: [INST] ... [/INST], an image as [IMG]
MISTRAL3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for block in message['content'] %}"
    "{% if block['type'] == 'text' %}{{ block['text'] }}{% elif block['type'] == 'image' %}[IMG]{% endif %}"
    "{% endfor %}{% endif %}[/INST]{% elif message['role'] == 'assistant' %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{{ message['content'][0]['text'] }}"
    "{% endif %}{{ eos_token }}{% endif %}{% endfor %}"
)


def mistral3(dest: Path) -> None:
    """Pixtral's placeholder style: rows of [IMG] ended by [IMG_BREAK], the last by [IMG_END]."""
    from transformers import (
        MistralConfig,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        PixtralImageProcessor,
        PixtralProcessor,
        PixtralVisionConfig,
    )

    tok = tokenizer(["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"])
    vision = PixtralVisionConfig(**TOWER_56, head_dim=16)
    config = Mistral3Config(
        vision_config=vision,
        text_config=MistralConfig(**text_config(tok), head_dim=16),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    images = PixtralImageProcessor(size={"longest_edge": 56}, patch_size={"height": 14, "width": 14})
    processor = PixtralProcessor(images, tok, patch_size=14, spatial_merge_size=2, chat_template=MISTRAL3_TEMPLATE)
    save(Mistral3ForConditionalGeneration(config), processor, dest)


# HuggingFaceTB/SmolVLM-Instruct's format
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


# What Idefics3 and SmolVLM share: the tile framing tokens (a 2x2 grid of row/column tags at most) and
# image sizes (112-pixel images cut into 56-pixel tiles plus a global view)
TILE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 3) for c in range(1, 3)
]
TILE_SIZES = dict(size={"longest_edge": 112}, max_image_size={"longest_edge": 56})


def tiled_config(config_class, vision_class, tok):
    """Idefics3's config (SmolVLM's is the same under its own classes): 56-pixel tiles through the
    tower, pixel-shuffled 2 x 2 to 4 slots each, a Llama decoder (ids from ``tok``)."""
    from transformers import LlamaConfig

    return config_class(
        vision_config=vision_class(**TOWER_56),
        text_config=LlamaConfig(**text_config(tok)).to_dict(),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )


def idefics3(dest: Path) -> None:
    """Idefics3 / SmolVLM: an image split into tiles plus a global view, each tile's slots framed by
    ``<fake_token_around_image>`` and a ``<row_r_col_c>`` tag."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        Idefics3VisionConfig,
    )

    tok = tokenizer(TILE_TOKENS)
    config = tiled_config(Idefics3Config, Idefics3VisionConfig, tok)
    images = Idefics3ImageProcessor(**TILE_SIZES)
    processor = Idefics3Processor(images, tok, image_seq_len=4, chat_template=IDEFICS3_TEMPLATE)
    save(Idefics3ForConditionalGeneration(config), processor, dest)


def smolvlm(dest: Path) -> None:
    """SmolVLM (2): Idefics3's tiles under its own classes, with a video processor (the model has no
    get_video_features: images only)."""
    from transformers import (
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
        SmolVLMVisionConfig,
    )

    tok = tokenizer([*TILE_TOKENS, "<video>"])
    config = tiled_config(SmolVLMConfig, SmolVLMVisionConfig, tok)
    images = SmolVLMImageProcessor(**TILE_SIZES)
    videos = SmolVLMVideoProcessor(size={"longest_edge": 56}, max_image_size={"longest_edge": 56})
    processor = SmolVLMProcessor(images, tok, videos, image_seq_len=4, chat_template=IDEFICS3_TEMPLATE)
    save(SmolVLMForConditionalGeneration(config), processor, dest)


# llava-hf/llava-v1.6-mistral-7b-hf's format ([INST] <image>\ntext [/INST])
LLAVA_NEXT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<<SYS>>\n' + message['content'][0]['text']"
    " + '\n<</SYS>>\n\n' }}{% elif message['role'] == 'user' %}{{ '[INST] ' }}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'][0]['text'] + '</s> '}}{% endif %}{% endfor %}"
)


def llava_next(dest: Path) -> None:
    """LLaVA-NeXT: "any resolution" tiles chosen by the image's size (``image_sizes``), a newline
    embedding after each row of the unpadded grid."""
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    tok = tokenizer(["<image>"])
    ids = tok.convert_tokens_to_ids
    config = llava_style(
        LlavaNextConfig, tok, image_token_index=ids("<image>"), image_grid_pinpoints=PINPOINTS, **LLAVA_FEATURES
    )
    images = LlavaNextImageProcessor(**CLIP_SIZES, image_grid_pinpoints=PINPOINTS)
    processor = LlavaNextProcessor(images, tok, **LLAVA_PROCESSING, chat_template=LLAVA_NEXT_TEMPLATE)
    save(LlavaNextForConditionalGeneration(config), processor, dest)


# llava-hf/llava-onevision-qwen2-0.5b-ov-hf's format (ChatML)
LLAVA_ONEVISION_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>\n' }}{% endfor %}{# Render all text next #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\n' + content['text'] }}"
    "{% endfor %}{{'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def llava_onevision(dest: Path) -> None:
    """LLaVA-OneVision: "anyres_max" tiles, pooled, a newline embedding per row and after the image."""
    from transformers import (
        LlamaConfig,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        SiglipVisionConfig,
    )

    tok = tokenizer(["<image>", "<video>"])
    vision = SiglipVisionConfig(**VISION, image_size=28, patch_size=14)
    config = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=LlamaConfig(**text_config(tok)).to_dict(),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=PINPOINTS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    images = LlavaOnevisionImageProcessor(size={"height": 28, "width": 28}, image_grid_pinpoints=PINPOINTS)
    videos = LlavaOnevisionVideoProcessor(size={"height": 28, "width": 28})
    processor = LlavaOnevisionProcessor(
        images,
        tok,
        videos,
        num_image_tokens=4,
        vision_feature_select_strategy="full",
        chat_template=LLAVA_ONEVISION_TEMPLATE,
    )
    save(LlavaOnevisionForConditionalGeneration(config), processor, dest)


# CohereLabs/aya-vision-8b's format
AYA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|START_OF_TURN_TOKEN|>' }}"
    "{% if message['role'] == 'user' %}{{ '<|USER_TOKEN|>' }}{% else %}{{ '<|CHATBOT_TOKEN|>' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<image>' }}{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|END_OF_TURN_TOKEN|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"
)


# What Aya Vision and Command A Vision share: Cohere's turn tokens, a SigLIP tower, a Cohere 2 decoder
# (logit scale, a sliding-window layer then a full one)
COHERE_TURN_TOKENS = ["<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>"]


def cohere_parts(tok):
    """The (vision, text) configs of the Cohere vision models; ids from ``tok``."""
    from transformers import Cohere2Config, SiglipVisionConfig

    text = Cohere2Config(**text_config(tok), sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    return SiglipVisionConfig(**TOWER_56), text


def aya_vision(dest: Path) -> None:
    """Aya Vision: tiles plus a global view, each a TILE tag and rows of ``<|IMG_PATCH|>`` slots ended
    by ``<|IMG_LINE_BREAK|>``, framed by ``<|START_OF_IMG|>`` / ``<|END_OF_IMG|>``; a Cohere 2 decoder
    (logit scale, sliding-window layers)."""
    from transformers import (
        AyaVisionConfig,
        AyaVisionForConditionalGeneration,
        AyaVisionProcessor,
        GotOcr2ImageProcessor,
    )

    image_tokens = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]
    tok = tokenizer(image_tokens + COHERE_TURN_TOKENS)
    vision, text = cohere_parts(tok)
    config = AyaVisionConfig(
        vision_config=vision,
        text_config=text,
        downsample_factor=2,
        image_token_index=tok.convert_tokens_to_ids("<|IMG_PATCH|>"),
    )
    images = GotOcr2ImageProcessor(size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1, max_patches=4)
    processor = AyaVisionProcessor(
        images, tok, patch_size=14, img_size=56, downsample_factor=2, chat_template=AYA_TEMPLATE
    )
    save(AyaVisionForConditionalGeneration(config), processor, dest)


def cohere2_vision(dest: Path) -> None:
    """Command A Vision: tiles of ``<|IMG_PATCH|>`` slots, each ended by ``<|IMG_LINE_BREAK|>``."""
    from transformers import (
        Cohere2VisionConfig,
        Cohere2VisionForConditionalGeneration,
        Cohere2VisionImageProcessor,
        Cohere2VisionProcessor,
    )

    named = {
        "boi_token": "<|START_OF_IMG|>",
        "eoi_token": "<|END_OF_IMG|>",
        "image_token": "<|IMG_PATCH|>",
        "img_line_break_token": "<|IMG_LINE_BREAK|>",
    }
    tok = tokenizer([*named.values(), *COHERE_TURN_TOKENS], named)
    vision, text = cohere_parts(tok)
    config = Cohere2VisionConfig(
        vision_config=vision,
        text_config=text,
        downsample_factor=2,
        alignment_intermediate_size=64,
        image_token_id=tok.image_token_id,
    )
    images = Cohere2VisionImageProcessor(
        size={"height": 56, "width": 56}, patch_size=2, crop_to_patches=True, max_patches=4
    )
    template = AYA_TEMPLATE.replace("'<image>'", "'<|IMG_PATCH|>'")
    save(
        Cohere2VisionForConditionalGeneration(config), Cohere2VisionProcessor(images, tok, chat_template=template), dest
    )


# OpenGVLab/InternVL3-1B-hf's format (ChatML, an image as <IMG_CONTEXT>)
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\n' }}{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)


def internvl(dest: Path) -> None:
    """InternVL: tiles plus a thumbnail, pixel-shuffled, their ``<IMG_CONTEXT>`` slots between ``<img>``
    and ``</img>``."""
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
        InternVLVisionConfig,
        Qwen2Config,
    )

    named = {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    }
    tok = tokenizer([*named.values(), "<|im_start|>", "<|im_end|>"], named)
    vision = InternVLVisionConfig(**TOWER_56)
    config = InternVLConfig(
        vision_config=vision,
        text_config=Qwen2Config(**text_config(tok)),
        image_token_id=tok.context_image_token_id,
        image_seq_length=4,
        downsample_ratio=0.5,
    )
    images = GotOcr2ImageProcessor(size={"height": 56, "width": 56}, crop_to_patches=True, max_patches=4)
    videos = InternVLVideoProcessor(size={"height": 56, "width": 56})
    processor = InternVLProcessor(images, tok, videos, image_seq_length=4, chat_template=INTERNVL_TEMPLATE)
    save(InternVLForConditionalGeneration(config), processor, dest)


def vipllava(dest: Path) -> None:
    """ViP-LLaVA: LLaVA's placeholders, features from five tower layers at once."""
    from transformers import VipLlavaConfig, VipLlavaForConditionalGeneration

    tok = tokenizer(["<image>"])
    config = llava_style(
        VipLlavaConfig, tok, image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layers=[-2, -1]
    )
    save(VipLlavaForConditionalGeneration(config), llava_processor(tok), dest)


def llava_next_video(dest: Path) -> None:
    """LLaVA-NeXT-Video, its images: LLaVA-NeXT's tiles beside a video token of its own."""
    from transformers import (
        LlavaNextImageProcessor,
        LlavaNextVideoConfig,
        LlavaNextVideoForConditionalGeneration,
        LlavaNextVideoProcessor,
        LlavaNextVideoVideoProcessor,
    )

    tok = tokenizer(["<image>", "<video>"])
    ids = tok.convert_tokens_to_ids
    config = llava_style(
        LlavaNextVideoConfig,
        tok,
        image_token_index=ids("<image>"),
        video_token_index=ids("<video>"),
        image_grid_pinpoints=PINPOINTS,
        **LLAVA_FEATURES,
    )
    images = LlavaNextImageProcessor(**CLIP_SIZES, image_grid_pinpoints=PINPOINTS)
    videos = LlavaNextVideoVideoProcessor(**CLIP_SIZES)
    processor = LlavaNextVideoProcessor(videos, images, tok, **LLAVA_PROCESSING, chat_template=LLAVA_VIDEO_TEMPLATE)
    save(LlavaNextVideoForConditionalGeneration(config), processor, dest)


# HuggingFaceM4/idefics2-8b's format
IDEFICS2_TEMPLATE = (
    "{% for message in messages %}{{message['role'].capitalize()}}{% if message['content'][0]['type'] == 'image' %}"
    "{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}"
    "{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def idefics2(dest: Path) -> None:
    """Idefics2: a perceiver resampler to a fixed number of ``<image>`` slots, framed by
    ``<fake_token_around_image>``."""
    from transformers import (
        Idefics2Config,
        Idefics2ForConditionalGeneration,
        Idefics2ImageProcessor,
        Idefics2Processor,
        Idefics2VisionConfig,
        MistralConfig,
    )

    tok = tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>"])
    vision = Idefics2VisionConfig(**TOWER_56)
    perceiver = dict(
        hidden_size=TEXT["hidden_size"],
        resampler_n_latents=4,
        resampler_depth=1,
        resampler_n_heads=2,
        resampler_head_dim=16,
        num_key_value_heads=1,
    )
    config = Idefics2Config(
        vision_config=vision.to_dict(),
        perceiver_config=perceiver,
        text_config=MistralConfig(**text_config(tok)).to_dict(),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
    )
    images = Idefics2ImageProcessor(size={"shortest_edge": 56, "longest_edge": 56})
    processor = Idefics2Processor(images, tok, image_seq_len=4, chat_template=IDEFICS2_TEMPLATE)
    save(Idefics2ForConditionalGeneration(config), processor, dest)


# zai-org/GLM-4.1V-9B-Thinking's format (an image as <|begin_of_image|><|image|><|end_of_image|>)
GLM4V_TEMPLATE = (
    "[gMASK]<sop>{% for msg in messages %}{{ '<|' + msg['role'] + '|>' }}\n{% if msg['content'] is string %}"
    "{{ msg['content'] }}{% else %}{% for item in msg['content'] %}{% if item['type'] == 'image' %}"
    "<|begin_of_image|><|image|><|end_of_image|>{% elif item['type'] == 'video' %}"
    "<|begin_of_video|><|video|><|end_of_video|>{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def glm4v(dest: Path) -> None:
    """GLM-4V: Qwen2-VL-like patch merging and M-RoPE positions from the model's ``get_rope_index``."""
    from transformers import (
        Glm4vConfig,
        Glm4vForConditionalGeneration,
        Glm4vImageProcessor,
        Glm4vProcessor,
        Glm4vTextConfig,
        Glm4vVideoProcessor,
        Glm4vVisionConfig,
    )

    tokens = [
        "[gMASK]",
        "<sop>",
        "<|user|>",
        "<|assistant|>",
        "<|begin_of_image|>",
        "<|end_of_image|>",
        "<|image|>",
        "<|begin_of_video|>",
        "<|end_of_video|>",
        "<|video|>",
    ]
    tok = tokenizer(tokens)
    ids = tok.convert_tokens_to_ids
    vision = Glm4vVisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        image_size=56,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=TEXT["hidden_size"],
    )
    text = Glm4vTextConfig(
        **text_config(tok),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [1, 1, 2],
            "partial_rotary_factor": 0.5,
        },
    )
    config = Glm4vConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids("<|image|>"),
        video_token_id=ids("<|video|>"),
        image_start_token_id=ids("<|begin_of_image|>"),
        image_end_token_id=ids("<|end_of_image|>"),
        video_start_token_id=ids("<|begin_of_video|>"),
        video_end_token_id=ids("<|end_of_video|>"),
    )
    pixels = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    images = Glm4vImageProcessor(size=pixels, patch_size=14, merge_size=2, temporal_patch_size=2)
    videos = Glm4vVideoProcessor(size=pixels, patch_size=14, merge_size=2, temporal_patch_size=2)
    processor = Glm4vProcessor(images, tok, videos, chat_template=GLM4V_TEMPLATE)
    save(Glm4vForConditionalGeneration(config), processor, dest)


# google/paligemma2-3b-mix-224 has no chat template (prompts go to the processor bare): this one
# renders one user turn as such a prompt, the images first
PALIGEMMA_TEMPLATE = (
    "{% for message in messages %}{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>"
    "{% endif %}{% endfor %}{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endfor %}"
)


def paligemma(dest: Path) -> None:
    """PaliGemma: its whole prompt (image, BOS, text, newline) attended both ways (``token_type_ids``),
    positions from 1."""
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    tok = tokenizer(["<image>"])
    vision = SiglipVisionConfig(**TOWER_56)
    text = GemmaConfig(**{**text_config(tok), "initializer_range": 0.2}, head_dim=16)
    config = PaliGemmaConfig(
        vision_config=vision,
        text_config=text.to_dict(),
        projection_dim=TEXT["hidden_size"],
        image_token_index=tok.convert_tokens_to_ids("<image>"),
    )
    images = SiglipImageProcessor(size={"height": 56, "width": 56})
    images.image_seq_length = 16  # (56 / 14) ** 2 patches
    processor = PaliGemmaProcessor(images, tok, chat_template=PALIGEMMA_TEMPLATE)
    model = PaliGemmaForConditionalGeneration(config)
    with torch.no_grad():  # Gemma scales embeddings by sqrt(hidden): at the other weights' size, outputs vary
        model.get_input_embeddings().weight.mul_(0.1)
    save(model, processor, dest)


# swiss-ai/Apertus (v1)'s chat format (v1.5's was not at hand), reduced to what one user turn renders
# (no system / developer blocks): <|user_start|>...<|user_end|><|assistant_start|>; media items become the processor's
# placeholders, in the order given
APERTUS1P5_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user_start|>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant_start|>' }}{% else %}{{ '<|system_start|>' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|image|>' }}{% elif item['type'] == 'audio' %}{{ '<|audio|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '<|user_end|>' }}{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant_end|>' }}{% else %}{{ '<|system_end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant_start|>' }}{% endif %}"
)

# The processor's structure tokens (EMU3.5's image framing: "<boi>H*W<wrapper>rows joined by <eol><eoi>")
APERTUS1P5_TOKENS = {
    "image_token": "<|image|>",
    "audio_token": "<|audio|>",
    "boi_token": "<|image start|>",
    "eoi_token": "<|image end|>",
    "image_wrapper_token": "<|image token|>",
    "eol_token": "<|extra_200|>",
    "boa_token": "<|audio start|>",
    "eoa_token": "<|audio end|>",
}


def apertus1p5(dest: Path) -> None:
    """Apertus 1.5: discrete image and audio codes in the text vocabulary. The vision tokenizer
    (32 channels, GroupNorm's 32 groups being the floor) downsamples by 4 over 3 stages; images are resized
    to at most 16x16 pixels (examples/photo.jpg, 240x320: 12x16, a grid of 4 rows of 3). The audio
    tokenizer keeps WavTokenizer's hop of 600 samples (40 codes a second at 24 kHz) with 4 base filters.
    Both codebooks hold 16 codes; the LM head is pruned to the tokenizer's own ids, as the released
    checkpoints' is."""
    from transformers import (
        Apertus1p5Config,
        Apertus1p5ForConditionalGeneration,
        Apertus1p5ImageProcessor,
        Apertus1p5Processor,
        Apertus1p5TextConfig,
        Apertus1p5VisionTokenizerConfig,
        WavTokenizerEncoderConfig,
        WavTokenizerFeatureExtractor,
    )

    named = APERTUS1P5_TOKENS
    tok = tokenizer(
        [
            *named.values(),
            "<|user_start|>",
            "<|user_end|>",
            "<|assistant_start|>",
            "<|assistant_end|>",
            "<|system_start|>",
            "<|system_end|>",
        ],
        named,
    )
    vision = Apertus1p5VisionTokenizerConfig(
        codebook_size=16,
        embed_dim=16,
        latent_channels=16,
        base_channels=32,
        channel_multiplier=(1, 1, 1),
        num_res_blocks=1,
        attn_resolutions=(),
        resolution=16,
    )
    audio = WavTokenizerEncoderConfig(
        num_filters=4,
        upsampling_ratios=(6, 5, 5, 4),
        num_lstm_layers=1,
        hidden_size=16,
        codebook_size=16,
        codebook_dim=16,
        decoder_hidden_size=16,
        decoder_intermediate_size=32,
        decoder_num_layers=1,
        decoder_attention_num_groups=4,
    )
    image_offset = len(tok)  # codes follow the tokenizer's own ids
    audio_offset = image_offset + vision.codebook_size
    rope = {
        "rope_type": "llama3",
        "rope_theta": 12000000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }  # Apertus' scaling, within 2048
    text = Apertus1p5TextConfig(
        **text_config(tok, output_vocab_size=image_offset, rope_parameters=rope)
        | {"vocab_size": audio_offset + audio.codebook_size}
    )
    config = Apertus1p5Config(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        image_token_id=tok.convert_tokens_to_ids(named["image_token"]),
        audio_token_id=tok.convert_tokens_to_ids(named["audio_token"]),
        image_token_offset=image_offset,
        audio_token_offset=audio_offset,
    )
    images = Apertus1p5ImageProcessor(
        size={"min_pixels": 8 * 8, "max_pixels": 16 * 16}, spatial_factor=vision.spatial_scale_factor
    )
    sounds = WavTokenizerFeatureExtractor(sampling_rate=24000, hop_length=audio.hop_length, normalize_audio=True)
    processor = Apertus1p5Processor(images, sounds, tok, chat_template=APERTUS1P5_TEMPLATE)
    model = Apertus1p5ForConditionalGeneration(config)
    audio_codebook(model.model.audio_tokenizer, sounds.sampling_rate)
    with torch.no_grad():  # at the other weights' size greedy decoding falls into a loop of 2 tokens
        model.get_input_embeddings().weight.mul_(3.0)
    save(model, processor, dest)


def audio_codebook(codec, sampling_rate: int) -> None:
    """WavTokenizer's codebook is initialised to zeros (every frame would be code 0), and random vectors
    lie far from what a random encoder emits (frames differ by a few percent): as a trained codebook
    holds centroids of the encoder's outputs, take one mid-clip frame of each of 16 tones (4 octaves,
    4 loudnesses), so that changing sound changes codes."""
    import numpy as np

    times = np.arange(sampling_rate) / sampling_rate
    size = codec.config.codebook_size
    tones = [(0.1 + 0.8 * (k % 4) / 3) * np.sin(2 * np.pi * 110 * 2 ** (4 * k / size) * times) for k in range(size)]
    with torch.no_grad():
        frames = codec.encoder(torch.tensor(np.stack(tones), dtype=torch.float32)[:, None])
        codebook = codec.quantizer.codebook
        codebook.embed.copy_(frames[:, :, frames.shape[-1] // 2])
        codebook.embed_avg.copy_(codebook.embed)


def save(model: torch.nn.Module, processor, dest: Path) -> None:
    """Write the checkpoint as ``save_pretrained`` does for any user, generation ending at EOS."""
    model.eval()
    model.generation_config.eos_token_id = processor.tokenizer.eos_token_id
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    processor.save_pretrained(dest)


BUILDERS: dict[str, Callable[[Path], None]] = {
    "llava": llava,
    "mistral3": mistral3,
    "idefics3": idefics3,
    "llava_next": llava_next,
    "llava_onevision": llava_onevision,
    "aya_vision": aya_vision,
    "cohere2_vision": cohere2_vision,
    "internvl": internvl,
    "vipllava": vipllava,
    "llava_next_video": llava_next_video,
    "idefics2": idefics2,
    "glm4v": glm4v,
    "paligemma": paligemma,
    "smolvlm": smolvlm,
    "apertus1p5": apertus1p5,
}


def build(model_type: str, dest: Path) -> Path:
    torch.manual_seed(0)
    BUILDERS[model_type](dest)
    return dest
