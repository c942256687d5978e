"""Modes are thin recipes over the library: each is a ``main(cfg)`` in its own module."""

from __future__ import annotations

import importlib
from typing import Callable

from omegaconf import DictConfig

from pipeline.errors import UserError

MODES = ("run", "chat", "batch", "ceval", "eval", "bench", "report", "serve")


def get_mode(name: str) -> Callable[[DictConfig], None]:
    if name not in MODES:
        raise UserError(f"unknown mode {name!r}: choose one of {', '.join(MODES)}")
    try:
        module = importlib.import_module(f"pipeline.modes.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"pipeline.modes.{name}":
            raise UserError(f"mode {name!r} is not available in this version") from None
        raise
    return module.main
