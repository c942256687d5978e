"""Sizes, special tokens and role tokens shared by the tokenizer and every family module.

Why one place: the tokenizer, the configs and the generation configs must agree on the same
token ids and sizes; any change here changes what gets written, so bump ``RECIPE_VERSION``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import GenerationConfig

# Written last into every built directory (``pipeline.tiny`` owns it: the loader reads it at runtime).
from pipeline.tiny.card import MARKER_FILE  # noqa: F401

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_FAMILY = "qwen2-vl"
# Bump when anything below changes what gets written (weights, tokenizer, configs): cached
# directories are keyed on it, so a stale cache is never reused.
RECIPE_VERSION = 1

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
# Special tokens, in the order the real tokenizers number them: (token, special?). Each
# family module lists its own as ``SPECIAL_TOKENS``; the Qwen families share these.
# --------------------------------------------------------------------------------------
QWEN_BASE_TOKENS = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True)]
QWEN_VISION_TOKENS = [
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
# Role tokens of the Qwen families: (bos, eos, pad, generation-config eos list). A family module
# names its own as ``ROLES``.
QWEN_ROLES: dict[str, Any] = {
    "bos": None,
    "eos": "<|im_end|>",
    "pad": "<|endoftext|>",
    "config_bos": "<|endoftext|>",
    "gen_eos": ["<|im_end|>", "<|endoftext|>"],
}
QWEN_SPECIAL_TOKENS = QWEN_BASE_TOKENS + QWEN_VISION_TOKENS  # what Qwen2-VL, Qwen2.5-VL and Qwen3-VL publish


def _vocab_size(tok: PreTrainedTokenizerBase) -> int:
    # Exactly len(tokenizer): a padded vocabulary (as real checkpoints have) would let a
    # random model emit ids that decode to nothing.
    return len(tok)


def _text_kwargs(tok: PreTrainedTokenizerBase, family: str, roles: dict[str, Any]) -> dict[str, Any]:
    """Decoder sizes and token ids (of the family's ``ROLES``), the same for every family's language model."""
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


def _generation_config(roles: dict[str, Any], tok: PreTrainedTokenizerBase) -> GenerationConfig:
    """Greedy generation stopping on the family's ``ROLES["gen_eos"]``."""
    ids = tok.convert_tokens_to_ids
    return GenerationConfig(
        bos_token_id=ids(roles["config_bos"]),
        eos_token_id=[ids(t) for t in roles["gen_eos"]],
        pad_token_id=ids(roles["pad"]),
        do_sample=False,
    )
