"""Model knowledge per family, so that stages stay generic: one file per family plus one yaml."""
from __future__ import annotations

from typing import Any

from pipeline.families.base import Family, TextFamily

# model_type (from config.json) -> "module:Class"; loaded lazily so a text run imports no vision code.
_BY_MODEL_TYPE: dict[str, str] = {
    "qwen2_vl": "pipeline.families.qwen2_vl:Qwen2VLFamily",
    "qwen2_5_vl": "pipeline.families.qwen2_vl:Qwen25VLFamily",
    "qwen2_audio": "pipeline.families.qwen2_audio:Qwen2AudioFamily",
}


def family_for_config(config: Any) -> Family:
    """The family that knows how to run a model with this config (text causal LM by default)."""
    target = _BY_MODEL_TYPE.get(getattr(config, "model_type", ""))
    if target is None:
        return TextFamily()
    module_name, cls_name = target.split(":")
    import importlib

    return getattr(importlib.import_module(module_name), cls_name)()


__all__ = ["Family", "TextFamily", "family_for_config"]
