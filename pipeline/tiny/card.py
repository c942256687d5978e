"""Where the embedded default lives and how a model directory the project wrote is recognised.

Why here, apart from the builders (``pipeline.testing``): the runtime needs these (the loader
reads ``MARKER_FILE`` through ``model_card``; the CLI falls back to ``default_model_dir()``), and
importing them must not pull in the tiny-model builders.
"""

from __future__ import annotations

import json
from pathlib import Path

# Written last into every model directory the project builds or trains; lets callers recognise a
# tiny model (e.g. for a "random weights, meaningless output" banner) and records how it was made.
MARKER_FILE = "mm_pipeline_tiny.json"

# The embedded default: a tiny Qwen2-VL trained by ``python -m scripts.train.train_shapes`` to name
# the shapes in images (``pipeline.tiny.shapes``); its files ship in the package.
SHAPES_MODEL_DIR = Path(__file__).resolve().parent / "shapes_model"


def default_model_dir() -> Path:
    """The embedded default model: the shipped toy shapes model (nothing to build, offline).

    Why trained rather than random: the first run shows a model looking at an image and
    answering correctly. ``pipeline.testing.tiny_model_dir(family)`` gives random-weight models for tests.
    """
    if not (SHAPES_MODEL_DIR / "model.safetensors").is_file() or model_card(SHAPES_MODEL_DIR) is None:
        raise FileNotFoundError(
            f"the embedded default model is missing from {SHAPES_MODEL_DIR}: re-create it with "
            "`python -m scripts.train.train_shapes` (or reinstall the package)"
        )
    return SHAPES_MODEL_DIR


def model_card(path: str | Path) -> dict | None:
    """The marker of a model directory the project wrote (how it was made, what it answers), or
    None for any other model (a hub id, someone's save_pretrained directory)."""
    try:
        card = json.loads((Path(path).expanduser() / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return card if isinstance(card, dict) else None
