"""Deterministic tiny models of real Hugging Face families, built offline by the project.

Why: the embedded default model and every test need a model that loads through the real
``from_pretrained(dir)`` path (config, safetensors, tokenizer, processor, chat template)
without downloading anything.  The embedded default is a tiny Qwen2-VL *trained* by the project
to name the shapes in images (``shapes``: the task; ``shapes_model/``: the shipped weights; the
training script is ``scripts/train/train_shapes.py`` in a checkout).  For tests, each family here gets random weights
(seeded, so two builds are byte-identical), a byte-level BPE tokenizer trained on a small
embedded corpus, the family's special tokens and published chat template, and - for the
multimodal families - the real processor classes (Qwen2-VL image/video processors, Whisper
feature extractor).

Layout: ``common`` (sizes, special/role tokens), ``tokenizer`` (``make_tokenizer``), one
module per family (``qwen3``, ``llama``, ``qwen2_vl``, ``qwen2_5_vl``, ``qwen2_audio``, ``gemma3``,
``qwen3_vl``, ``qwen2_5_omni``, ``qwen3_5`` and its text-only ``qwen3_5_text``),
``registry`` (family -> module) and ``build`` (``build_tiny``, the cache, ``default_model_dir``).

Public API: ``FAMILIES``, ``build_tiny``, ``make_tokenizer``, ``tiny_model_dir``,
``default_model_dir``, ``model_card``.
"""

from __future__ import annotations

from pipeline.tiny.build import build_tiny, default_model_dir, make_processor, model_card, tiny_model_dir
from pipeline.tiny.common import DEFAULT_FAMILY, MARKER_FILE, RECIPE_VERSION
from pipeline.tiny.registry import FAMILIES
from pipeline.tiny.tokenizer import make_tokenizer

# Not in __all__, but read as ``tiny.X`` (tests: CHAT_TEMPLATES, MAX_PIXELS) and public names of
# the former single module, so kept importable from here.
from pipeline.tiny.common import AUDIO_DIM, AUDIO_HEADS, AUDIO_LAYERS, HEAD_DIM, HEADS, HIDDEN  # noqa: F401
from pipeline.tiny.common import INIT_RANGE, INTERMEDIATE, KV_HEADS, LAYERS, MROPE_SECTION  # noqa: F401
from pipeline.tiny.common import MAX_PIXELS, MIN_PIXELS, NUM_MERGES  # noqa: F401
from pipeline.tiny.common import VISION_DEPTH, VISION_DIM, VISION_HEADS  # noqa: F401
from pipeline.tiny.llama import LLAMA3_CHAT_TEMPLATE  # noqa: F401
from pipeline.tiny.qwen2_audio import QWEN2_AUDIO_CHAT_TEMPLATE  # noqa: F401
from pipeline.tiny.qwen2_vl import QWEN2_VL_CHAT_TEMPLATE  # noqa: F401
from pipeline.tiny.qwen3 import QWEN3_CHAT_TEMPLATE  # noqa: F401
from pipeline.tiny.registry import CHAT_TEMPLATES  # noqa: F401

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
    "model_card",
]
