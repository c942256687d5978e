"""LoRA adapters beside a loaded model: read with peft, checked against the base, kept by name.

An adapter (peft's ``adapter_config.json`` + ``adapter_model.safetensors``) is read through
peft's own config and weight loading (``PeftConfig.from_pretrained``, ``load_peft_weights``),
never merged into the base: every target layer keeps the base weights, and the engine adds each
row's low-rank product ``B(A(x)) * scale`` in its forwards (``pipeline.runner.lora``), so many
adapters share one copy of the base model and rows of different adapters share a step.

What is honoured: the target modules, each layer's rank and alpha (``rank_pattern`` and
``alpha_pattern``), ``lora_alpha / r`` scaling or ``lora_alpha / sqrt(r)`` with rsLoRA; module
names saved against an older layout of the model are renamed as ``from_pretrained`` renames old
checkpoints (``current_names``). What is
refused, in one line, before the adapter serves anything: another kind of adapter than LoRA,
options that change the layer's arithmetic (DoRA, LoRA biases, trained copies of whole modules,
trainable tokens, LoRA on parameters), layers the base does not have or of another shape (an
adapter trained on another base), layers that are not linear (embeddings, convolutions), the
output layer (whose rows the engine keeps selectively), and tensor-parallel shards.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import UserError
from pipeline.model.quant import quiet_bitsandbytes

PREFIX = "base_model.model."  # peft's name for the base model inside a PeftModel
PARTS = (".lora_A.weight", ".lora_B.weight")
# Adapter options that change the layer's arithmetic, refused rather than run wrongly: config field -> what it is.
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "modules_to_save": "trained copies of whole modules (modules_to_save)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "layer_replication": "layer replication (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "fan_in_fan_out": "transposed (Conv1D) weights (fan_in_fan_out)",
}
_UIDS = itertools.count(1)


@dataclass(frozen=True)
class LoraLayer:
    """One target layer's factors: ``a`` [r, in], ``b`` [out, r] (float32, as peft keeps them
    beside 16-bit weights) and ``scale`` (alpha / r, or alpha / sqrt(r) with rsLoRA)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(eq=False)
class Adapter:
    """A loaded adapter. ``layers``: the base model's module name -> its factors; ``root``: the
    prefix cache's chain root for its requests (from its weights, so blocks computed under it
    are found again only under the same weights, in this process or a later one reading the
    disk tier); ``uid``: unique in this process (an adapter loaded again under the same name is
    another adapter)."""

    name: str
    source: str
    layers: dict[str, LoraLayer]
    root: int
    uid: int

    @property
    def nbytes(self) -> int:
        return sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size() for w in self.layers.values())

    @property
    def rank(self) -> int:
        return max(w.a.shape[0] for w in self.layers.values())


def read_adapter(name: str, source: str, model: torch.nn.Module, tp: int = 1) -> Adapter:
    """Read a peft LoRA adapter (a folder or a hub id) and check it fits ``model``; every
    problem is one ``UserError`` naming the adapter."""
    where = f"adapter {name!r} ({source})"
    if tp > 1:
        raise UserError(f"{where}: LoRA adapters are not supported with tensor parallel (model.tp={tp}) yet")
    config = _config(where, source)
    weights = _weights(where, source)
    layers = {}
    current = current_names(model)
    for saved_name, (a, b) in _pairs(where, weights).items():
        module_name = current(saved_name)
        layers[module_name] = _layer(where, config, model, module_name, a, b)
    if not layers:
        raise UserError(f"{where}: its weights hold no LoRA layers")
    return Adapter(name, str(source), layers, _root(layers), next(_UIDS))


def check_adapter(name: str, source: str) -> None:
    """Refuse, before the base model loads, an adapter whose config peft cannot read or whose
    kind or options are not supported (its weights are checked against the model at load)."""
    _config(f"adapter {name!r} ({source})", source)


def _check_source(where: str, source: str) -> None:
    """A folder that exists, or a hub id the hub answers for (or the local cache holds): one line
    at once, not peft's search through both and huggingface_hub's retries."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{where}: a file; give the folder peft's save_pretrained wrote")
        return
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise UserError(f"{where}: no such folder")
    from huggingface_hub import constants, try_to_load_from_cache

    from pipeline.model.loading import hub_unreachable

    cached = isinstance(try_to_load_from_cache(source, "adapter_config.json"), str)
    reason = None if constants.HF_HUB_OFFLINE or cached else hub_unreachable(source)
    if reason is not None:
        raise UserError(
            f"{where}: cannot reach the Hugging Face hub to fetch it (no network? {reason}): download it "
            "elsewhere and give its folder"
        )


def _config(where: str, source: str) -> Any:
    _check_source(where, source)
    quiet_bitsandbytes()  # peft imports bitsandbytes
    from peft import PeftConfig, PeftType

    try:
        config = PeftConfig.from_pretrained(source)
    except Exception as err:  # missing folder or file, bad JSON, hub errors: peft's own words
        raise UserError(f"{where}: not a peft adapter ({first_line(err)})") from None
    if config.peft_type != PeftType.LORA:
        raise UserError(f"{where}: a {config.peft_type} adapter; only LoRA adapters are supported")
    for field, what in UNSUPPORTED.items():
        if getattr(config, field, None):
            raise UserError(f"{where}: {what} is not supported")
    return config


def _weights(where: str, source: str) -> dict[str, torch.Tensor]:
    from peft.utils import load_peft_weights

    try:
        return load_peft_weights(source, device="cpu")
    except Exception as err:
        raise UserError(f"{where}: its weights could not be read ({first_line(err)})") from None


def _pairs(where: str, weights: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name -> (A, B), from peft's saved keys (``base_model.model.<module>.lora_A.weight``)."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        part = next((p for p in PARTS if key.endswith(p)), None)
        if part is None or not key.startswith(PREFIX):
            raise UserError(f"{where}: holds {key!r}, which is not a LoRA linear layer's factor (unsupported)")
        found.setdefault(key[len(PREFIX) : -len(part)], {})[part] = tensor
    for module_name, parts in found.items():
        if len(parts) != 2:
            raise UserError(f"{where}: {module_name} has only one of its two LoRA factors")
    return {m: (p[PARTS[0]], p[PARTS[1]]) for m, p in found.items()}


def current_names(model: torch.nn.Module) -> Any:
    """Saved module name -> this model's: adapters saved against an older layout of the model
    (transformers 4's Qwen2-VL ``model.layers``, now ``model.language_model.layers``) renamed by
    transformers' own conversion mapping, the one ``from_pretrained`` applies to old checkpoints."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings

        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    except (ImportError, AttributeError, TypeError):  # another transformers: names as saved
        renamings = []
    names = {name for name, _ in model.named_modules()}

    def current(saved: str) -> str:
        if saved in names or not renamings:
            return saved
        renamed = apply_renamings(saved, renamings)
        return renamed if renamed in names else saved

    return current


def _layer(
    where: str, config: Any, model: torch.nn.Module, module_name: str, a: torch.Tensor, b: torch.Tensor
) -> LoraLayer:
    """One target layer's factors, checked against the base model's module of that name."""
    from peft.utils.other import get_pattern_key

    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise UserError(
            f"{where}: targets {module_name}, which this model does not have (was it trained on another base model?)"
        ) from None
    if not isinstance(module, torch.nn.Linear):
        raise UserError(f"{where}: targets {module_name}, a {type(module).__name__}; only linear layers are supported")
    if module is model.get_output_embeddings():
        raise UserError(f"{where}: targets the output layer {module_name}, which is not supported")
    r = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != module.in_features or b.shape != (module.out_features, r):
        raise UserError(
            f"{where}: its factors for {module_name} ({tuple(a.shape)}, {tuple(b.shape)}) do not fit the layer "
            f"({module.in_features} in, {module.out_features} out): was it trained on another base model?"
        )
    alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module_name), config.lora_alpha)
    scale = alpha / math.sqrt(r) if config.use_rslora else alpha / r
    device = module.weight.device if module.weight.device.type != "meta" else torch.device("cpu")
    return LoraLayer(a.float().to(device), b.float().to(device), float(scale))


def _root(layers: dict[str, LoraLayer]) -> int:
    """The chain root for an adapter's cached blocks: a hash of its factors and scales."""
    h = hashlib.blake2b(digest_size=8)
    for module_name in sorted(layers):
        w = layers[module_name]
        h.update(module_name.encode())
        h.update(repr(w.scale).encode())
        for t in (w.a, w.b):
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


def first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


class Adapters:
    """The adapters loaded beside one model, by name (any thread may load, unload and look up).
    A request holds the ``Adapter`` it was admitted with, so unloading one does not disturb the
    requests already using it."""

    def __init__(self) -> None:
        self._by_name: dict[str, Adapter] = {}
        self._lock = threading.Lock()

    def load(self, name: str, source: str, model: torch.nn.Module, tp: int = 1, base: str | None = None) -> Adapter:
        """Read and add an adapter; a name already loaded (or the base model's ``base``) is refused."""
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise UserError(f"an adapter's name must be a non-empty string without surrounding spaces (got {name!r})")
        if name == base:
            raise UserError(f"adapter name {name!r} is the base model's name: choose another")
        with self._lock:
            if name in self._by_name:
                raise UserError(f"an adapter named {name!r} is already loaded (unload it first)")
        adapter = read_adapter(name, source, model, tp)
        with self._lock:
            if name in self._by_name:
                raise UserError(f"an adapter named {name!r} is already loaded (unload it first)")
            self._by_name[name] = adapter
        return adapter

    def unload(self, name: str) -> Adapter:
        with self._lock:
            if name not in self._by_name:
                raise UserError(f"no adapter named {name!r} is loaded{self._listing()}")
            return self._by_name.pop(name)

    def get(self, name: str) -> Adapter:
        """The adapter of that name; ``UserError`` listing the loaded ones otherwise."""
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is None:
                raise UserError(f"no adapter named {name!r} is loaded{self._listing()}")
            return adapter

    def _listing(self) -> str:
        return f" (loaded: {', '.join(sorted(self._by_name))})" if self._by_name else " (none is loaded: model.lora)"

    def loaded(self) -> list[Adapter]:
        with self._lock:
            return list(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._by_name

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_name)
