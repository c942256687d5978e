"""Family name -> the module that knows that family's template, config, model class and processor.

Discovered, not listed: every module in this package with a ``FAMILY`` name is a family (adding
one is adding its file). A family module defines ``FAMILY``, ``RANK`` (its place in
``FAMILIES``), ``ROLES``, ``SPECIAL_TOKENS``, ``CHAT_TEMPLATE``, ``make_config(tok)``,
``model_class()`` and, for media families, ``make_processor(tok)``.

Why a separate module: the tokenizer needs every family's chat template and the builder needs
every family's config, while family modules depend only on ``common``; keeping the lookup here
keeps the imports acyclic.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


_MACHINERY = {"build", "common", "registry", "tokenizer"}  # the package's own modules, not families


def _discover() -> dict[str, ModuleType]:
    package = importlib.import_module(__package__)
    names = [info.name for info in pkgutil.iter_modules(package.__path__) if info.name not in _MACHINERY]
    found = [importlib.import_module(f"{__package__}.{name}") for name in names]
    families = sorted((m for m in found if hasattr(m, "FAMILY")), key=lambda m: (m.RANK, m.FAMILY))
    return {m.FAMILY: m for m in families}


FAMILY_MODULES: dict[str, ModuleType] = _discover()
FAMILIES: tuple[str, ...] = tuple(FAMILY_MODULES)
CHAT_TEMPLATES: dict[str, str] = {family: m.CHAT_TEMPLATE for family, m in FAMILY_MODULES.items()}


def family_module(family: str) -> ModuleType:
    """The module of a tiny family; a clear error for a name no module has."""
    module = FAMILY_MODULES.get(family)
    if module is None:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(FAMILIES)}")
    return module
