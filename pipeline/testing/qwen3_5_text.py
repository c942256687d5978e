"""Qwen3.5 text-only: ``Qwen3_5ForCausalLM`` (``model_type`` ``qwen3_5_text``), the language model of
``qwen3.5`` without its vision tower, as text-only Qwen3.5 checkpoints ship it (``model.path=`` one).

Why a family of its own: a checkpoint's ``config.json`` decides what loads, and a text-only one
names ``qwen3_5_text`` and ``Qwen3_5ForCausalLM``; the same tokenizer, template and decoder
settings as ``qwen3.5`` (``pipeline.testing.qwen3_5``), so the two differ only by the tower.
``build_tiny("qwen3.5-text", dir)`` writes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.testing.qwen3_5 import CHAT_TEMPLATE, ROLES, SPECIAL_TOKENS  # noqa: F401  (the registry reads them here)
from pipeline.testing.qwen3_5 import make_text_config

# transformers' config, model and processor classes are imported in the functions that use them: each
# pulls in its family's modeling code, and ``import pipeline`` imports every family module (the registry).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

FAMILY = "qwen3.5-text"
RANK = 9


def make_config(tok: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The ``qwen3.5`` language model's config as a ``Qwen3_5TextConfig`` (ids from ``tok``)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**make_text_config(tok))


def model_class() -> type[PreTrainedModel]:
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM
