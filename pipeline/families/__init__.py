"""Model knowledge per family, so that stages stay generic: one file per family plus one yaml."""
from __future__ import annotations

from typing import Any

from pipeline.errors import UserError
from pipeline.families.base import Family, TextFamily

# model_type (from config.json) -> "module:Class"; loaded lazily so a text run imports no vision code.
_BY_MODEL_TYPE: dict[str, str] = {
    "qwen2_vl": "pipeline.families.qwen2_vl:Qwen2VLFamily",
    "qwen2_5_vl": "pipeline.families.qwen2_vl:Qwen25VLFamily",
    "qwen2_audio": "pipeline.families.qwen2_audio:Qwen2AudioFamily",
}


def family_for_config(config: Any) -> Family:
    """The family that knows how to run a model with this config. An architecture no family
    covers runs as a generic text model only when its layers are plain attention (what the
    paged KV cache holds); anything else is refused in one line, before the weights load."""
    from pipeline.memory import uncacheable_layers

    model_type = getattr(config, "model_type", "")
    target = _BY_MODEL_TYPE.get(model_type)
    if target is None:
        other = uncacheable_layers(config)
        if other:
            arch = ", ".join(getattr(config, "architectures", None) or [model_type or "this model"])
            known = ", ".join(sorted(_BY_MODEL_TYPE))
            raise UserError(
                f"{arch} is not supported: its {', '.join(sorted(other))} layers are not plain attention, which "
                f"is all the generic text family handles (families: {known}, and text models with plain attention)"
            )
        return TextFamily()
    module_name, cls_name = target.split(":")
    import importlib

    return getattr(importlib.import_module(module_name), cls_name)()


__all__ = ["Family", "TextFamily", "family_for_config"]
