"""The models a request may name, vLLM's way: the base model under its served name
(``serve.model_name``), or a LoRA adapter loaded beside it (``model.lora`` at start, or at run time
through ``POST /v1/load_lora_adapter``), whose name in ``model`` makes the request run with it
(``Request.adapter``). One place decides what a ``model`` means (``Models.resolve``): every
endpoint that runs the model asks it, so they all accept, refuse and echo the same names.

``/v1/models`` lists the base and each adapter (vLLM's ModelCard: ``root`` where it was read from,
``parent`` the base's served name). Loading and unloading answer with vLLM's texts; a request
already running with an adapter that is unloaded finishes with it (its sequence holds the adapter).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pipeline.errors import UserError
from pipeline.model.lora import Adapters
from pipeline.pipeline import Pipeline
from pipeline.serve.protocol import APIError, Body, ServeSettings

OWNER = "mm-pipeline"  # every card's owned_by
RUNTIME_OFF = "runtime adapter loading is off (serve.runtime_lora=false): adapters load at start with model.lora"


class _AdapterBody(Body):
    """An adapter endpoint's body: it names no model (a ``model`` given is refused, not ignored)."""

    def unsupported(self) -> list[str]:
        return sorted(super().unsupported() + (["model"] if self.model is not None else []))


class LoadLoraRequest(_AdapterBody):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(_AdapterBody):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: str


@dataclass(frozen=True)
class Target:
    """What a request's ``model`` chose: ``name``, the one its answer carries (vLLM echoes the
    adapter's name, else the base's served name), and ``adapter``, its requests' ``Request.adapter``
    (None: the base model)."""

    name: str
    adapter: str | None


class Models:
    """The base model and the adapters loaded beside it, as the API names them."""

    def __init__(self, pipe: Pipeline, settings: ServeSettings) -> None:
        self.pipe, self.base = pipe, settings.model_name
        self.started = int(time.time())

    @property
    def adapters(self) -> Adapters:
        return self.pipe.lm.adapters

    def resolve(self, model: str | None) -> Target:
        """The target ``model`` names (none given: the base); 404 listing what is served otherwise."""
        if not model or model == self.base:
            return Target(self.base, None)
        if model in self.adapters:
            return Target(model, model)
        raise APIError(404, f"model {model!r} not found: this server serves {self.served()}", code="model_not_found")

    def served(self) -> str:
        """What a 404 lists: the base's name and the adapters'."""
        names = sorted(a.name for a in self.adapters.loaded())
        if not names:
            return f"{self.base!r} (no adapter is loaded)"
        return f"{self.base!r} and the adapter{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))}"

    def cards(self, base: dict) -> list[dict]:
        """``/v1/models``' entries: the base (``base``: its other fields) first, then each adapter."""
        card = {"object": "model", "created": self.started, "owned_by": OWNER}
        first = {"id": self.base, **card, "root": self.pipe.lm.path, "parent": None, **base}
        loaded = sorted(self.adapters.loaded(), key=lambda a: a.name)
        return [first] + [{"id": a.name, **card, "root": a.source, "parent": self.base} for a in loaded]

    def load(self, name: str, path: str) -> str:
        """Read the adapter and serve it (blocking: run it off the event loop); vLLM's success text.
        A name taken, or an adapter that cannot be read or does not fit, is a 400 with its one line."""
        if name in self.adapters:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", code="invalid_value")
        try:
            self.pipe.lm.load_adapter(name, path, base=self.base)
        except UserError as err:
            raise APIError(400, str(err), code="invalid_value") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        """Stop serving the adapter (requests running with it finish with it); 404 when none has that name."""
        try:
            self.pipe.unload_adapter(name)
        except UserError:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", code="model_not_found") from None
        return f"Success: LoRA adapter '{name}' removed successfully."
