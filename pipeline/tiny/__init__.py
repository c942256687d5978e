"""The embedded default model: what the runtime needs when no model is named.

A tiny Qwen2-VL *trained* by the project to name the shapes in images: ``shapes`` (the synthetic
task and its questions), ``shapes_model/`` (the shipped weights, tokenizer and processor) and
``card`` (``default_model_dir``, ``model_card`` and ``MARKER_FILE``, the marker by which the loader
recognises a model directory the project wrote). The training script is
``scripts/train/train_shapes.py`` in a checkout.

Why apart from the random-weight builders of every family (``pipeline.testing``): the runtime
imports this package, and must not pull the builders in with it. Their names (``build_tiny``,
``tiny_model_dir``, ``FAMILIES``, ``make_tokenizer``, ``CHAT_TEMPLATES``...) lived here before and
are still read from here, forwarded to ``pipeline.testing`` on first use.

Public API: ``default_model_dir``, ``model_card``, ``MARKER_FILE``, ``SHAPES_MODEL_DIR``.
"""

from __future__ import annotations

import importlib
from typing import Any

from pipeline.tiny.card import MARKER_FILE, SHAPES_MODEL_DIR, default_model_dir, model_card

__all__ = ["MARKER_FILE", "SHAPES_MODEL_DIR", "default_model_dir", "model_card"]

_FORWARDED = "pipeline.testing"


def __getattr__(name: str) -> Any:
    """``pipeline.tiny.build_tiny`` and the other builder names, from ``pipeline.testing`` (imported
    only now, so the runtime's ``import pipeline.tiny`` stays without it)."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "shapes":  # ``from pipeline.tiny import shapes`` asks here first: its own module, not a builder
        return importlib.import_module(f"{__name__}.{name}")
    try:
        value = getattr(importlib.import_module(_FORWARDED), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # once: later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(importlib.import_module(_FORWARDED).__all__))
