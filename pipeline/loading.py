"""load_model: a hub id or a local save_pretrained directory, through transformers + accelerate."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

from pipeline.errors import UserError
from pipeline.families import Family, family_for_config


@dataclass
class LoadedModel:
    """A model with what the stages need next to it: tokenizer, processor, family, placement."""

    model: Any
    tokenizer: Any
    processor: Any | None
    family: Family
    path: str
    quant: str = "none"
    placement: dict = field(default_factory=dict)  # device -> {dtype/quant: bytes}

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def weights_bytes(self) -> int:
        return sum(sum(kinds.values()) for kinds in self.placement.values())

    @property
    def eos_token_ids(self) -> set[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return set()
        return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def resolve_dtype(dtype: str | torch.dtype | None, device_map: Any) -> torch.dtype | str:
    """"auto" means float32 on CPU (exact and fast enough for small models) and bfloat16 on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        on_gpu = torch.cuda.is_available() and device_map not in ("cpu", {"": "cpu"})
        return torch.bfloat16 if on_gpu else torch.float32
    try:
        value = getattr(torch, str(dtype))
    except AttributeError:
        value = None
    if not isinstance(value, torch.dtype):
        raise UserError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return value


_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def _check_path(path: str) -> None:
    """Local directories are checked here; anything shaped like org/name is left to the hub."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise UserError(f"model.path {path!r} is a file: give the directory written by save_pretrained")
        if not (p / "config.json").is_file():
            raise UserError(f"model.path {path!r} has no config.json: not a save_pretrained directory")
    elif not _HUB_ID.match(path) or path.startswith("."):
        raise UserError(f"model.path {path!r} does not exist")


def placement_of(model: Any) -> dict:
    """Bytes of weights per device and per dtype / quantised storage type."""
    out: dict[str, dict[str, int]] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        kind = type(tensor).__name__ if type(tensor).__name__ not in ("Parameter", "Tensor") else str(tensor.dtype).replace("torch.", "")
        quant_type = getattr(tensor, "quant_type", None)
        if quant_type:
            kind = f"{kind}:{quant_type}"
        dev = str(tensor.device)
        out.setdefault(dev, {})
        out[dev][kind] = out[dev].get(kind, 0) + tensor.numel() * tensor.element_size()
    return out


def load_model(
    path: str,
    *,
    dtype: str | torch.dtype | None = "auto",
    device_map: Any = None,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
    quantization_config: Any = None,
    quant_name: str = "none",
    trust_remote_code: bool = False,
    processor_kwargs: dict | None = None,
) -> LoadedModel:
    """Load weights, tokenizer/processor and the family; bad paths become one-line UserErrors."""
    path = str(path)
    _check_path(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load model {path!r}: {str(err).splitlines()[0]}") from None
    family = family_for_config(config)
    torch_dtype = resolve_dtype(dtype, device_map)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "use_safetensors": True, "trust_remote_code": trust_remote_code}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if max_memory:
        kwargs["max_memory"] = dict(max_memory)
    if offload_folder:
        kwargs["offload_folder"] = offload_folder
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    auto_class = getattr(transformers, family.auto_class)
    try:
        model = auto_class.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load model {path!r}: {str(err).splitlines()[0]}") from None
    if device_map is None and torch.cuda.is_available() and quantization_config is None:
        model.to("cuda")
    model.eval()
    processor = None
    if family.uses_processor:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code, **(processor_kwargs or {}))
        tokenizer = processor.tokenizer
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        processor=processor,
        family=family,
        path=path,
        quant=quant_name,
        placement=placement_of(model),
    )
