"""How big the KV pool is: ``kv.memory`` turned into blocks (and recurrent-state slots)."""
from __future__ import annotations

from typing import Any

import torch

from pipeline.errors import UserError, whole_number
from pipeline.kv.pool import BlockPool
from pipeline.kv.states import state_shape
from pipeline.memory import cache_devices, fmt_bytes, free_bytes, kv_bytes


def kv_memory_setting(value: Any) -> float | int | str:
    """``kv.memory`` checked: ``auto`` (also None), a number of bytes, or a fraction in (0, 1]."""
    if value is None or value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
        isinstance(value, float) and value > 1
    ):
        raise UserError(f"kv.memory must be auto, a number of bytes, or a fraction in (0, 1] (got {value!r})")
    return value


def pool_for(
    lm: Any, memory: float | int | str | None = None, block_size: int = 16, checkpoint_every: int = 1024,
    max_seqs: int = 8,
) -> BlockPool:
    """A pool sized by ``memory`` (``kv_memory_setting``): bytes, a fraction of what is free now,
    or ``auto``: 80% of free CUDA memory, or on CPU 25% of available RAM up to 2 GiB (blocks are
    touched only as they are first used, so an unused part costs nothing). Free memory honours
    ``model.max_memory``; a pool that does not fit, or has no room for one block, is refused with
    the numbers.

    A model with linear-attention layers also gets recurrent-state slots out of the same bytes
    (``state_budget``): two per sequence in flight (``max_seqs``: its state and the one a forward
    writes) plus one checkpoint per ``checkpoint_every`` tokens the blocks hold.
    """
    memory = kv_memory_setting(memory)
    block_size = whole_number("kv.block_size", block_size)
    checkpoint_every = whole_number("kv.state_checkpoint_every", checkpoint_every)
    devices = cache_devices(lm)
    device = next((d for d in devices if d.type == "cuda"), devices[0] if devices else torch.device("cpu"))
    dtype = _kv_dtype(lm)
    block_bytes = kv_bytes(lm.config, block_size, dtype)
    nbytes, asked = _budget(memory, device, lm)
    shape = state_shape(lm.config, dtype)
    if shape is None:
        blocks, slots, reserved = nbytes // block_bytes, 0, 0
    else:
        if checkpoint_every % block_size:
            raise UserError(f"kv.state_checkpoint_every ({checkpoint_every}) must be a multiple of kv.block_size "
                            f"({block_size}): checkpoints at block boundaries serve the prefix cache")
        blocks, slots, reserved = state_budget(nbytes, block_bytes, block_size, shape.slot_bytes, checkpoint_every, max_seqs)
    if blocks < 1:
        states = f" after {slots} recurrent-state slots ({fmt_bytes(slots * shape.slot_bytes)})" if slots else ""
        raise UserError(
            f"{asked} gives {fmt_bytes(nbytes)}: not even one KV block of {block_size} tokens "
            f"({block_bytes:,} bytes){states}: raise kv.memory or model.max_memory"
        )
    return BlockPool(lm.config, blocks + 1, block_size, dtype, devices,  # + the null block
                     state_slots=slots + 1 if slots else 0, checkpoint_every=checkpoint_every, reserved_slots=reserved)


def _budget(memory: float | int | str, device: torch.device, lm: Any) -> tuple[int, str]:
    """The bytes ``kv.memory`` asks for on ``device``, and how to name the ask in an error."""
    free, source = free_bytes(device, lm)
    if memory == "auto":
        share = "80" if device.type == "cuda" else "25"
        nbytes = int(0.8 * free) if device.type == "cuda" else min(int(0.25 * free), 2 << 30)
        return nbytes, f"kv.memory=auto ({share}% of {fmt_bytes(free)} free, {source})"
    if isinstance(memory, float):
        return int(memory * free), f"kv.memory={memory} of {fmt_bytes(free)} free ({source})"
    asked = f"kv.memory={int(memory):,} bytes"
    if memory > free:
        raise UserError(
            f"{asked} is more than the {fmt_bytes(free)} ({free:,} bytes) free on {device} ({source}): lower kv.memory"
        )
    return int(memory), asked


def state_budget(
    nbytes: int, block_bytes: int, block_size: int, slot_bytes: int, checkpoint_every: int, max_seqs: int
) -> tuple[int, int, int]:
    """(KV blocks, state slots, slots reserved for live states) that fit in ``nbytes``: each
    sequence in flight needs two slots; checkpoints get one slot per ``checkpoint_every`` tokens
    of blocks, and at least two per sequence (its prompt's end and last block boundary)."""
    live = 2 * max_seqs
    per_token = block_bytes / block_size + slot_bytes / checkpoint_every
    tokens = max(0, nbytes - (live + 2 * max_seqs) * slot_bytes) / per_token
    checkpoints = max(2 * max_seqs, -(-int(tokens) // checkpoint_every))
    blocks = int((nbytes - (live + checkpoints) * slot_bytes) // block_bytes)
    return max(blocks, 0), live + checkpoints, live


def _kv_dtype(lm: Any) -> torch.dtype:
    """Keys and values come out in the compute dtype (bf16/fp16 under 4-bit weights too)."""
    dtype = getattr(lm.model, "dtype", torch.float32)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        dtype = torch.float32
    quant = getattr(getattr(lm.model, "config", None), "quantization_config", None)
    compute = getattr(quant, "bnb_4bit_compute_dtype", None)
    return compute if isinstance(compute, torch.dtype) else dtype
