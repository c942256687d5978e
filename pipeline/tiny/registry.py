"""Family name -> the module that knows that family's template, config, model class and processor.

Why a separate module: the tokenizer needs every family's chat template and the builder
needs every family's config, while family modules depend only on ``common``; keeping the
lookup here keeps the imports acyclic.
"""

from __future__ import annotations

from types import ModuleType

from pipeline.tiny import llama, qwen2_5_vl, qwen2_audio, qwen2_vl, qwen3
from pipeline.tiny.common import FAMILIES

FAMILY_MODULES: dict[str, ModuleType] = {m.FAMILY: m for m in (qwen3, llama, qwen2_vl, qwen2_5_vl, qwen2_audio)}
assert tuple(FAMILY_MODULES) == FAMILIES, "every family needs exactly one module, in FAMILIES order"

CHAT_TEMPLATES: dict[str, str] = {family: FAMILY_MODULES[family].CHAT_TEMPLATE for family in FAMILIES}
