"""Real-size architectures with random weights, built from published config values (no download).

Speed does not depend on weight values, so a random-weight model of the real shapes measures
what the real one would. The tokenizer and processor are the embedded tiny Qwen2-VL ones (same
special tokens and chat template, small vocabulary); the model keeps the real vocabulary size,
so the embedding and lm_head cost what they really cost.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Qwen/Qwen2-VL-2B-Instruct: config.json and preprocessor_config.json (published values).
QWEN2_VL_2B_TEXT = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    use_sliding_window=False,
    sliding_window=32768,
    max_window_layers=28,
    attention_dropout=0.0,
    initializer_range=0.02,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)
QWEN2_VL_2B_VISION = dict(
    depth=32,
    embed_dim=1280,
    hidden_size=1536,
    hidden_act="quick_gelu",
    mlp_ratio=4,
    num_heads=16,
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    initializer_range=0.02,
)
QWEN2_VL_2B_PIXELS = dict(min_pixels=56 * 56, max_pixels=16384 * 28 * 28)
# The issues' CPU reference shape: a 187M-parameter Llama (text only).
LLAMA_187M = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
ARCHS = ("qwen2-vl-2b", "llama-187m", "llava-shapes")


def build_qwen2_vl_2b(out_dir: Path, device: str, layers: int | None = None, vision_depth: int | None = None) -> Path:
    """Write a save_pretrained directory (bfloat16, random weights) once; later calls reuse it.

    ``layers`` / ``vision_depth`` shrink the model to check a script quickly on CPU.
    """
    layers = layers or QWEN2_VL_2B_TEXT["num_hidden_layers"]
    vision_depth = vision_depth or QWEN2_VL_2B_VISION["depth"]
    recipe = {"arch": "qwen2-vl-2b", "layers": layers, "vision_depth": vision_depth, "weights": "random"}
    marker = out_dir / "mm_pipeline_bench.json"
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        return out_dir
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from pipeline.testing import make_processor, make_tokenizer

    tok = make_tokenizer("qwen2-vl")
    ids = tok.convert_tokens_to_ids
    text = dict(
        QWEN2_VL_2B_TEXT,
        num_hidden_layers=layers,
        max_window_layers=layers,
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(QWEN2_VL_2B_VISION, depth=vision_depth),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=[ids("<|im_end|>")], pad_token_id=ids("<|endoftext|>"))
    processor = make_processor("qwen2-vl", tok)
    image_processor = processor.image_processor
    image_processor.min_pixels = QWEN2_VL_2B_PIXELS["min_pixels"]
    image_processor.max_pixels = QWEN2_VL_2B_PIXELS["max_pixels"]
    image_processor.size = {"shortest_edge": image_processor.min_pixels, "longest_edge": image_processor.max_pixels}
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    marker.write_text(json.dumps(recipe) + "\n")
    return out_dir


def build_llama_187m(out_dir: Path, dtype: torch.dtype = torch.float32, tokenizer: str = "tiny") -> Path:
    """The 187M-parameter Llama shape with random weights (``dtype``); later calls reuse it.

    ``tokenizer``: ``"tiny"`` is the embedded tiny Qwen3 one (its ids all lie within the 32,000-token
    vocabulary); ``"bpe"`` a byte-level BPE trained to the full 32,000 tokens (``bpe_tokenizer``),
    for figures that scale with the vocabulary (a grammar's compile time and masks)."""
    recipe = {"arch": "llama-187m", "dtype": str(dtype), "weights": "random", "tokenizer": tokenizer}
    marker = out_dir / "mm_pipeline_bench.json"
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        return out_dir
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from pipeline.testing import make_tokenizer

    tok = make_tokenizer("qwen3") if tokenizer == "tiny" else bpe_tokenizer(LLAMA_187M["vocab_size"])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(**LLAMA_187M, bos_token_id=eos, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=[eos], pad_token_id=tok.pad_token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    marker.write_text(json.dumps(recipe) + "\n")
    return out_dir


def build_llava_shapes(out_dir: Path) -> Path:
    """A LLaVA (CLIP tower, Qwen2 decoder) whose decoder has exactly the embedded Qwen2-VL's text shape
    and vocabulary (random weights): the generic vision family against a dedicated family, decode
    being text-only (issue 48). Its processor is LLaVA's own, with the embedded tokenizer plus ``<image>``."""
    recipe = {"arch": "llava-shapes", "weights": "random"}
    marker = out_dir / "mm_pipeline_bench.json"
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        return out_dir
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
    )

    from pipeline.tiny import default_model_dir

    text = AutoConfig.from_pretrained(default_model_dir()).text_config.to_dict()
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    shape = {
        k: text[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "tie_word_embeddings",
        )
    }
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
            projection_dim=32,
        ),
        text_config=Qwen2Config(
            **shape,
            vocab_size=len(tok),
            rope_parameters={"rope_type": "default", "rope_theta": 200.0},
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    images = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        images,
        tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tok.chat_template,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    marker.write_text(json.dumps(recipe) + "\n")
    return out_dir


def build_arch(arch: str, root: Path, device: str, dtype: torch.dtype) -> Path:
    """The model a benchmark's ``--arch`` names, under ``root`` (one folder per architecture, and
    per dtype for the Llama shape, so switching dtypes does not rebuild it)."""
    if arch == "qwen2-vl-2b":
        return build_qwen2_vl_2b(root / arch, device)
    if arch == "llama-187m":
        return build_llama_187m(root / f"{arch}-{str(dtype).removeprefix('torch.')}", dtype)
    if arch == "llava-shapes":
        return build_llava_shapes(root / arch)
    raise ValueError(f"unknown architecture {arch!r}: one of {', '.join(ARCHS)}")


def bpe_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on the Python standard library's
    own source (seconds; no download), with Qwen's chat tokens and the tiny Qwen3 chat template: a
    real-sized vocabulary of real merges, for costs that grow with the vocabulary."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pipeline.testing import make_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if not {"site-packages", "test"} & set(p.parts))
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator((p.read_text(errors="replace") for p in files), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = make_tokenizer("qwen3").chat_template
    return tok
