"""Qwen2.5-VL: Qwen2-VL's template, tokens and processors with the windowed-attention vision tower."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.testing.common import HIDDEN, INIT_RANGE, QWEN_ROLES, QWEN_SPECIAL_TOKENS, VISION_DEPTH, VISION_DIM
from pipeline.testing.common import VISION_HEADS
from pipeline.testing.qwen2_vl import QWEN2_VL_CHAT_TEMPLATE, _text_config, _vl_config, _vl_processor

# transformers' config, model and processor classes are imported in the functions that use them: each
# pulls in its family's modeling code, and ``import pipeline`` imports every family module (the registry).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

FAMILY = "qwen2.5-vl"
RANK = 3
ROLES = QWEN_ROLES
SPECIAL_TOKENS = QWEN_SPECIAL_TOKENS

CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE


def window_tower() -> dict[str, Any]:
    """The windowed-attention vision tower (its last block full-attention), as Qwen2.5-VL and
    Qwen2.5-Omni's thinker both have it."""
    return dict(
        depth=VISION_DEPTH,
        hidden_size=VISION_DIM,
        intermediate_size=2 * VISION_DIM,
        out_hidden_size=HIDDEN,
        num_heads=VISION_HEADS,
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[VISION_DEPTH - 1],
        hidden_act="silu",
        initializer_range=INIT_RANGE,
    )


def make_config(tok: PreTrainedTokenizerBase) -> PretrainedConfig:
    """A 2-layer Qwen2.5-VL whose last vision block is full-attention; token ids from ``tok``."""
    from transformers import Qwen2_5_VLConfig

    return _vl_config(Qwen2_5_VLConfig, tok, _text_config(tok, FAMILY), {**window_tower(), "tokens_per_second": 2})


def model_class() -> type[PreTrainedModel]:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration


def make_processor(tok: PreTrainedTokenizerBase) -> ProcessorMixin:
    """The real ``Qwen2_5_VLProcessor`` around ``tok``."""
    from transformers import Qwen2_5_VLProcessor

    return _vl_processor(Qwen2_5_VLProcessor, tok)
