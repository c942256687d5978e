"""Model knowledge per family, so that stages stay generic: one file per family plus one yaml."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from pipeline.errors import UserError
from pipeline.families import vision
from pipeline.families.base import Family, TextFamily
from pipeline.memory import ATTENTION_KINDS, layer_kinds, text_config


def registry() -> dict[str, type[Family]]:
    """model_type -> family class, found in this package's modules: adding a family is adding
    its file (plus its model yaml and tiny builder), never editing a table here."""
    found: dict[str, type[Family]] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Family) and obj.__module__ == module.__name__:
                for model_type in obj.model_types:
                    found[model_type] = obj
    return found


def family_for_config(config: Any) -> Family:
    """The family that knows how to run a model with this config. An architecture no family
    covers runs as a generic text model only when its layers are full or sliding-window
    attention (what the paged KV cache holds); anything else is refused in one line, before the
    weights load, as is attention that soft-caps its logits in any family."""
    model_type = getattr(config, "model_type", "")
    softcap = getattr(text_config(config), "attn_logit_softcapping", None)
    if softcap is not None:  # (Gemma 2: every request would fail in the paged attention)
        raise UserError(
            f"{_architectures(config)} is not supported: its attention soft-caps its logits "
            f"(attn_logit_softcapping={softcap}), which the paged attention does not do"
        )
    families = registry()
    if model_type not in families and vision.claims(config):
        reason = vision.refusal(config)
        if reason is not None:
            raise UserError(f"{_architectures(config)} ({model_type}) is not supported: {reason}")
        return vision.VisionFamily(config)
    if model_type not in families:
        # Not even linear attention: only the families that declare it (Qwen3.5's Gated DeltaNet)
        # run it, and transformers names Mamba, lightning and other linear layers the same way.
        other = set(layer_kinds(config)) - ATTENTION_KINDS
        if other:
            known = ", ".join(sorted({cls.name for cls in families.values()}))
            raise UserError(
                f"{_architectures(config)} is not supported: its {', '.join(sorted(other))} layers are not full or "
                f"sliding-window attention, which is all the generic text family handles (families: {known}, and "
                "text models with such attention)"
            )
        return TextFamily()
    return families[model_type]()


def _architectures(config: Any) -> str:
    """How a refusal names the model: its config's architectures, else its model type."""
    return ", ".join(getattr(config, "architectures", None) or [getattr(config, "model_type", "") or "this model"])


__all__ = ["Family", "TextFamily", "family_for_config", "registry"]
