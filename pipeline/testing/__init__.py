"""Deterministic tiny random-weight models of real Hugging Face families, built offline (named for
tests, like ``torch.testing``).

Why: every test and benchmark needs a model that loads through the real ``from_pretrained(dir)``
path (config, safetensors, tokenizer, processor, chat template) without downloading anything.
Each family here gets random weights (seeded, so two builds are byte-identical), a byte-level BPE
tokenizer trained on a small embedded corpus, the family's special tokens and published chat
template, and - for the multimodal families - the real processor classes (Qwen2-VL image/video
processors, Whisper feature extractor). Installed, so users' own tests can build them too; the
runtime never imports it (an import-linter contract). The embedded default the runtime does need
(trained weights and their loader) is ``pipeline.tiny``.

Layout: ``common`` (sizes, special/role tokens), ``tokenizer`` (``make_tokenizer``), one
module per family (``qwen3``, ``llama``, ``qwen2_vl``, ``qwen2_5_vl``, ``qwen2_audio``, ``gemma3``,
``qwen3_vl``, ``qwen2_5_omni``, ``qwen3_5`` and its text-only ``qwen3_5_text``; discovered by
``registry``: adding a family is adding its module) and ``build`` (``build_tiny``, the cache).

Public API: ``FAMILIES``, ``build_tiny``, ``make_tokenizer``, ``make_processor``, ``tiny_model_dir``.
"""

from __future__ import annotations

from pipeline.testing.build import build_tiny, make_processor, tiny_model_dir
from pipeline.testing.common import DEFAULT_FAMILY, MARKER_FILE, RECIPE_VERSION
from pipeline.testing.registry import FAMILIES
from pipeline.testing.tokenizer import make_tokenizer

# Not in __all__, but read as ``testing.X`` (tests: CHAT_TEMPLATES, MAX_PIXELS) and public names of
# the former single module, so kept importable from here.
from pipeline.testing.common import AUDIO_DIM, AUDIO_HEADS, AUDIO_LAYERS, HEAD_DIM, HEADS, HIDDEN  # noqa: F401
from pipeline.testing.common import INIT_RANGE, INTERMEDIATE, KV_HEADS, LAYERS, MROPE_SECTION  # noqa: F401
from pipeline.testing.common import MAX_PIXELS, MIN_PIXELS, NUM_MERGES  # noqa: F401
from pipeline.testing.common import VISION_DEPTH, VISION_DIM, VISION_HEADS  # noqa: F401
from pipeline.testing.llama import LLAMA3_CHAT_TEMPLATE  # noqa: F401
from pipeline.testing.qwen2_audio import QWEN2_AUDIO_CHAT_TEMPLATE  # noqa: F401
from pipeline.testing.qwen2_vl import QWEN2_VL_CHAT_TEMPLATE  # noqa: F401
from pipeline.testing.qwen3 import QWEN3_CHAT_TEMPLATE  # noqa: F401
from pipeline.testing.registry import CHAT_TEMPLATES  # noqa: F401

__all__ = [
    "FAMILIES",
    "DEFAULT_FAMILY",
    "RECIPE_VERSION",
    "MARKER_FILE",
    "build_tiny",
    "make_tokenizer",
    "make_processor",
    "tiny_model_dir",
]
