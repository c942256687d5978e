"""``kv.offload``: the settings of the prefix cache's second tier, and a pool joined to its tier.

What a tier holds is only valid for the weights and settings that computed it, so a disk tier's
files carry a fingerprint of them (``fingerprint``): the model's config, a sample of every
weight's bytes (two fine-tunes of one config differ there), how the weights were quantised, and
the pool's layout (``kv.dtype``, block size, heads). Files of another model or setting are
refused and the request recomputes.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.errors import UserError
from pipeline.kv.pool import BlockPool
from pipeline.kv.tier import check_tier, make_tier

log = logging.getLogger(__name__)
DEFAULT_BYTES = 4 << 30  # kv.offload_bytes when unset
_SAMPLE = 64  # bytes of each weight the fingerprint reads (its first ones)


@dataclass(frozen=True)
class Offload:
    """``kv.offload`` (none | host | disk), its bound in bytes, and a disk tier's folder."""

    kind: str = "none"
    nbytes: int = DEFAULT_BYTES
    folder: str | None = None

    @classmethod
    def checked(cls, kind: str, nbytes: int | None = None, folder: str | None = None) -> "Offload":
        """The settings, refused in one line when they cannot work together."""
        check_tier(kind, folder)
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0):
            raise UserError(f"kv.offload_bytes must be a positive number of bytes (got {nbytes!r})")
        return cls(kind, DEFAULT_BYTES if nbytes is None else nbytes, str(folder) if folder else None)


def attach_tier(pool: BlockPool, offload: Offload, lm: Any) -> None:
    """Give ``pool`` the second tier ``offload`` asks for (nothing for ``none``)."""
    check_offload(offload.kind, pool.states is not None, pool.shards)
    if offload.kind == "none":
        return
    pin = any(torch.device(d).type == "cuda" for d in pool.devices)
    pool.tier = make_tier(offload.kind, pool.block_bytes, offload.nbytes, offload.folder, fingerprint(pool, lm), pin)
    if offload.kind == "disk":  # what the prefix cache holds at the end stays for the next process
        pool.spill_on_close = True  # when the pool is dropped, and at exit if it is still alive then
        atexit.register(_spill, weakref.ref(pool))


def _spill(ref: weakref.ref) -> None:
    pool = ref()
    if pool is not None:
        kept = pool.spill()
        if kept:
            log.info("kv.offload=disk: %d cached blocks written to %s", kept, pool.tier.folder)


def check_offload(kind: str, recurrent: bool, shards: int, model: str = "this model") -> None:
    """Refuse a tier the pool cannot serve: a block of a model with recurrent states is useless
    without the state at its end (not offloaded), and under tensor parallel each rank holds only
    its own heads."""
    if kind == "none":
        return
    if recurrent:
        raise UserError(
            f"kv.offload keeps key/value blocks only: {model}'s linear-attention layers also need their "
            "recurrent states, which are not offloaded (use kv.offload=none)"
        )
    if shards > 1:
        raise UserError(
            "kv.offload under tensor parallel is not supported: each rank holds only its own heads "
            "(use kv.offload=none)"
        )


def fingerprint(pool: BlockPool, lm: Any) -> str:
    """What the blocks' bytes depend on, as a string a disk tier keeps in every file's header."""
    model = getattr(lm, "model", lm)
    config = getattr(model, "config", None)
    parts = {
        "config": hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:32] if config else "",
        "weights": weights_digest(model),
        "quant": str(getattr(lm, "quant", "none")),
        "pool": [
            pool.kv_dtype,
            str(pool.dtype),
            pool.block_size,
            pool.layers,
            pool.kv_heads,
            pool.head_dim,
            pool.shards,
        ],
        "torch": torch.__version__.split("+")[0],
    }
    return json.dumps(parts, sort_keys=True)


def weights_digest(model: Any) -> str:
    """A hash of every parameter's name, shape, dtype and first bytes: cheap (no full read of a
    large model) and different for two checkpoints that share a config. Quantised weights are read
    through the plain tensors that hold them (``_stored``), never reshaped: a torchao tensor has no
    view of its data, and its scales are part of what the weights are."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in model.named_parameters() if hasattr(model, "named_parameters") else ():
        h.update(f"{name}{tuple(p.shape)}{p.dtype}{type(p.data).__name__}".encode())
        if p.device.type == "meta":
            continue
        for part in _stored(p.detach()):
            if part.numel():
                flat = part.reshape(-1)
                head = flat[: max(1, _SAMPLE // flat.element_size())]
                h.update(head.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _stored(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a weight's bytes live in: a wrapper subclass (torchao's ``Int8Tensor``:
    int8 data and row scales) through ``__tensor_flatten__``; bitsandbytes' parameters as their own
    bytes plus their scales (``quant_state.absmax``, ``SCB``)."""
    if type(tensor) is torch.Tensor:
        return [tensor]
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return [
            leaf for n in names if isinstance(getattr(tensor, n), torch.Tensor) for leaf in _stored(getattr(tensor, n))
        ]
    state = getattr(tensor, "quant_state", None)
    scales = [getattr(state, "absmax", None), getattr(tensor, "SCB", None)]
    return [tensor.as_subclass(torch.Tensor), *(s for s in scales if isinstance(s, torch.Tensor))]
