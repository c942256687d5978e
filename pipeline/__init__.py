"""mm-pipeline: multimodal LLM inference as composable, measurable stages.

The names below load on first use (PEP 562), so that what needs none of them (``python -m
pipeline --help``, a misspelt setting) answers without importing torch and transformers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipeline.cli.settings import register as _register_settings

_register_settings()  # conf/config.yaml composes over the settings schema (Hydra's ConfigStore)

_HOMES = {
    "Context": "pipeline.context",
    "Request": "pipeline.context",
    "Result": "pipeline.context",
    "UserError": "pipeline.errors",
    "KVCache": "pipeline.kv",
    "Snapshot": "pipeline.kv",
    "LoadedModel": "pipeline.model.loading",
    "load_model": "pipeline.model.loading",
    "Metrics": "pipeline.metrics",
    "Pipeline": "pipeline.pipeline",
    "follow": "pipeline.pipeline",
}
__all__ = [
    "Context",
    "Request",
    "Result",
    "UserError",
    "KVCache",
    "Snapshot",
    "LoadedModel",
    "load_model",
    "Metrics",
    "Pipeline",
    "follow",
]  # _HOMES' keys, spelt out for tools that read __all__

if TYPE_CHECKING:
    from pipeline.context import Context, Request, Result
    from pipeline.errors import UserError
    from pipeline.kv import KVCache, Snapshot
    from pipeline.model.loading import LoadedModel, load_model
    from pipeline.metrics import Metrics
    from pipeline.pipeline import Pipeline, follow


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # once: later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
