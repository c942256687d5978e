"""KV-cache arithmetic and free memory: what sizes the paged KV pool before anything is allocated.

Why: a pool larger than what the device has left after the weights dies later (CUDA OOM, or the
kernel's OOM killer on CPU, where the pool's pages are touched only as it fills); checked up
front, the run stops at once with the numbers.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Sequence

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from pipeline.errors import UserError


def text_config(config: Any) -> Any:
    """Multimodal configs keep the language model's sizes in their text config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layers(config: Any) -> tuple[list[str], list[dict]]:
    """Each decoder layer's cache kind and its settings (``sliding_window``), read as
    transformers' own caches read them: ``layer_types``, or, where a config has none, sliding
    when it sets ``sliding_window`` (Mistral) and chunked when it sets ``attention_chunk_size``."""
    kinds, kwargs = get_layer_types_and_kwargs(text_config(config))
    return list(kinds), list(kwargs)


def layer_kinds(config: Any) -> list[str]:
    """Each decoder layer's cache kind (``full_attention``, ``sliding_attention``, ...)."""
    return _layers(config)[0]


ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention"})  # layers that keep keys and values
# A quantised kv.dtype stores one byte an element plus a scale of this dtype per position and
# head (pipeline.kv.quantised says why); "auto" stores keys and values in the model's dtype.
KV_SCALE_DTYPE = torch.bfloat16


def uncacheable_layers(config: Any) -> set[str]:
    """Layer kinds the paged pool cannot hold (chunked attention, convolutions, ...). Full and
    sliding-window attention it holds as KV blocks (every position kept, the attention masks keys
    older than the window); linear attention as recurrent states (``pipeline.kv.states``)."""
    return set(layer_kinds(config)) - ATTENTION_KINDS - {"linear_attention"}


def sliding_window(config: Any) -> int | None:
    """The window of the sliding-attention layers (None: the model has none). One window per
    model: a config whose layers disagree is refused in one line."""
    kinds, kwargs = _layers(config)
    windows = {
        int(kw["sliding_window"])
        for kind, kw in zip(kinds, kwargs)
        if kind == "sliding_attention" and kw.get("sliding_window")
    }
    if len(windows) > 1:
        raise UserError(f"the paged KV cache handles one sliding window per model; this one has {sorted(windows)}")
    return windows.pop() if windows else None


def kv_shape(config: Any, shards: int = 1) -> tuple[int, int, int]:
    """(decoder layers, key/value heads, head dim) of the language model; the heads one of
    ``shards`` tensor-parallel ranks holds."""
    text = text_config(config)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return int(text.num_hidden_layers), kv_heads // shards, head_dim


def kv_bytes_per_layer(
    config: Any, tokens: int, dtype: torch.dtype, shards: int = 1, kv_dtype: str = "auto"
) -> list[int]:
    """Bytes of keys + values each decoder layer holds for ``tokens`` positions.

    Sliding-window layers count every position too: the paged pool keeps them all (a block is
    shared by every layer, and reuse, rollback and the prefix cache need the whole history), so
    a sliding window saves no KV memory here. Linear-attention layers keep none (their state is
    per sequence, not per position: ``pipeline.kv.states``). ``shards``: one tensor-parallel
    rank's share. ``kv_dtype``: a quantised ``kv.dtype`` (one byte an element, a scale a head).
    """
    _, kv_heads, head_dim = kv_shape(config, shards)
    if kv_dtype == "auto":
        per_head = head_dim * dtype.itemsize
    else:
        per_head = head_dim + KV_SCALE_DTYPE.itemsize
    return [2 * kv_heads * per_head * tokens if kind in ATTENTION_KINDS else 0 for kind in layer_kinds(config)]


def kv_bytes(config: Any, tokens: int, dtype: torch.dtype, shards: int = 1, kv_dtype: str = "auto") -> int:
    """Bytes of the whole KV cache for ``tokens`` positions (all layers, keys and values; one
    tensor-parallel rank's share of ``shards``; ``kv_dtype`` as in ``kv_bytes_per_layer``)."""
    return sum(kv_bytes_per_layer(config, tokens, dtype, shards, kv_dtype))


def _decoder_layers(model: Any, encoders: Sequence[str] = ()) -> list[Any]:
    """The language model's decoder layers (the ModuleList the KV cache has one entry per), not
    an encoder's (``encoders``: the family's ``encoder_modules``) of the same length."""
    n = int(text_config(model.config).num_hidden_layers)
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList) and len(module) == n:
            if not set(encoders).intersection(name.split(".")):
                return list(module)
    return []


def _execution_device(module: Any, fallback: torch.device) -> torch.device:
    """Where a layer computes (its cache lives there): accelerate's hook knows for offloaded ones."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return fallback


def cache_devices(lm: Any) -> list[torch.device]:
    """One device per decoder layer (the model's device when layers cannot be found)."""
    layers = _decoder_layers(lm.model, lm.family.encoder_modules)
    fallback = torch.device(lm.device)
    if not layers:
        return [fallback] * int(text_config(lm.config).num_hidden_layers)
    return [_execution_device(layer, fallback) for layer in layers]


def available_ram() -> int:
    """Bytes the OS can still give this process without swapping."""
    return _ram("available", "SC_AVPHYS_PAGES")


@functools.cache
def total_ram() -> int:
    """Bytes of RAM the machine has."""
    return _ram("total", "SC_PHYS_PAGES")


def _ram(field: str, pages: str) -> int:
    """psutil's ``virtual_memory().<field>``, else the OS's count of ``pages`` (sysconf)."""
    try:
        import psutil

        return int(getattr(psutil.virtual_memory(), field))
    except ImportError:  # psutil comes with accelerate; this is only a fallback
        return int(os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE"))


def free_bytes(device: torch.device, lm: Any) -> tuple[int, str]:
    """(bytes free for the cache on ``device``, where that figure comes from) - for the message.

    CUDA: free device memory, capped by model.max_memory[index] minus what torch holds there.
    CPU: available RAM, capped by model.max_memory["cpu"] minus the weights on the CPU.
    """
    budgets = getattr(lm, "max_memory", None) or {}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        free = int(torch.cuda.mem_get_info(index)[0])
        if index in budgets:
            left = budgets[index] - int(torch.cuda.memory_allocated(index))
            if left < free:
                return max(left, 0), f"model.max_memory[{index}]={fmt_bytes(budgets[index])} minus allocated"
        return free, f"free on cuda:{index}"
    free = available_ram()
    key = device.type
    if key in budgets:
        weights = sum((getattr(lm, "placement", None) or {}).get(key, {}).values())
        left = budgets[key] - weights
        if left < free:
            return max(
                left, 0
            ), f"model.max_memory['{key}']={fmt_bytes(budgets[key])} minus {fmt_bytes(weights)} of weights"
    return free, "available RAM"


def stored_bytes(tensor: Any) -> int:
    """Bytes a tensor really holds: a quantised tensor subclass (torchao's) reports its logical
    dtype's size, so its inner tensors (packed data, scales, zero points) are counted instead."""
    if not isinstance(tensor, torch.Tensor):
        return 0
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        inner, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in inner)
    return tensor.numel() * tensor.element_size()


def fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def release_cached_memory(device: torch.device | str | None) -> None:
    """Hand the allocator's cached blocks back to the device (after an out-of-memory error, so
    the retry starts from what is really in use)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
