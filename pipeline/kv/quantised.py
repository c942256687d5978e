"""Quantised keys and values (``kv.dtype=int8|fp8``): one byte an element in the paged pool.

Each position's key (and value) of each head is stored as one byte an element with a bfloat16
scale of its own: ``int8`` rounds ``x / scale`` to an integer in [-127, 127] with ``scale`` just
above ``max|x| / 127``; ``fp8`` casts ``x / scale`` to float8 e4m3 with ``scale`` just above
``max|x| / 448``.

Why a scale per position and head rather than per block: a block fills one token at a time
(decode writes one position a step), so a block-wide scale would have to be fixed before its
largest value is seen, or every earlier position requantised when it grows. Per position the
write is final, rollback and copy-on-write move bytes only, and the cost is 2 bytes a head
(head_dim 64: 66 bytes instead of 128 in bfloat16, 1.94x the tokens; 128: 1.97x).
Why bfloat16 scales, rounded up: the scale is exactly representable in the model's dtype (bfloat16,
float16 over its range, float32), so dequantising is one multiply in that dtype, with no float32
copy of what a step reads (measured: 0.73x full precision's batch throughput through float32,
see docs/kv-cache.md); rounding up (at most 2^-8 above max|x| / 127) means nothing is clipped,
and the step grows by at most 0.6%. float32 scales would cost 2 bytes more a head.

Attention dequantises what a step reads (the gathered rows of each sequence) to the model's
dtype; FlexAttention, which reads the pool in place, is not used on a quantised pool
(``pipeline.runner.flex.usable``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.errors import UserError
from pipeline.memory import KV_SCALE_DTYPE

__all__ = ["KVFormat", "LayerKV", "dequantise", "kv_format", "quantise"]

_SCALE_MIN = torch.finfo(torch.float32).tiny
_ROUND_UP = 1 + 2.0**-8  # bfloat16 rounds to nearest within 2^-9: the stored scale is never below max|x| / top


@dataclass(frozen=True)
class KVFormat:
    """How a quantised ``kv.dtype`` stores an element: ``storage`` is the pool tensor's dtype
    (float8 bytes are kept as uint8: CPU has no index_copy / index_fill for float8), ``top`` the
    largest magnitude ``x / scale`` takes."""

    name: str
    storage: torch.dtype
    top: float

    @property
    def is_fp8(self) -> bool:
        return self.name == "fp8"


FORMATS = {
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8": KVFormat("fp8", torch.uint8, float(torch.finfo(torch.float8_e4m3fn).max)),
}
KV_DTYPES = ("auto", *FORMATS)  # kv.dtype: "auto" is the model's own dtype


def kv_format(kv_dtype: str) -> KVFormat | None:
    """The format of ``kv.dtype`` (None for ``auto``: the model's own dtype), refusing others."""
    if kv_dtype not in KV_DTYPES:
        raise UserError(f"kv.dtype must be one of {', '.join(KV_DTYPES)} (got {kv_dtype!r})")
    return FORMATS.get(kv_dtype)


def quantise(fmt: KVFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., head_dim] -> (bytes [..., head_dim] in ``fmt.storage``, bfloat16 scales [...]).
    The scale is rounded to bfloat16 before dividing, so dequantising with the stored scale
    inverts exactly what was rounded."""
    unit = x.float()  # a fresh tensor (or x's float32 self: divided out of place below)
    scale = (torch.linalg.vector_norm(unit, float("inf"), dim=-1) * (_ROUND_UP / fmt.top)).to(KV_SCALE_DTYPE)
    unit = unit / scale.float().clamp_(min=_SCALE_MIN).unsqueeze(-1)
    if fmt.is_fp8:
        return unit.clamp_(-fmt.top, fmt.top).to(torch.float8_e4m3fn).view(torch.uint8), scale
    return unit.round_().clamp_(-fmt.top, fmt.top).to(torch.int8), scale


def dequantise(fmt: KVFormat, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``quantise``'s inverse in ``dtype``: [..., head_dim] from bytes and their scales: one
    conversion, then one multiply in place (on CPU 1.4x faster than letting int8 x bfloat16
    promote inside the multiply)."""
    values = (q.view(torch.float8_e4m3fn) if fmt.is_fp8 else q).to(dtype)
    return values.mul_(scale.to(dtype).unsqueeze(-1))


class LayerKV:
    """One attention layer's keys and values in the pool ([slots, kv_heads, head_dim] each), and
    for a quantised pool their scales ([slots, kv_heads]): what attention writes and reads."""

    __slots__ = ("k", "v", "k_scale", "v_scale", "fmt")

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        fmt: KVFormat | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        self.k, self.v, self.fmt, self.k_scale, self.v_scale = k, v, fmt, k_scale, v_scale

    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """``key``/``value`` [T, kv_heads, head_dim] into ``slots`` [T]."""
        if self.fmt is None:
            self.k.index_copy_(0, slots, key.to(self.k.dtype))
            self.v.index_copy_(0, slots, value.to(self.v.dtype))
            return
        for pool, scales, x in ((self.k, self.k_scale, key), (self.v, self.v_scale, value)):
            q, s = quantise(self.fmt, x)
            pool.index_copy_(0, slots, q)
            scales.index_copy_(0, slots, s)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., head_dim] as a read of the pool would give it back: attention over a
        prompt's own new keys sees the same values as a later request's prefix hit."""
        return x if self.fmt is None else dequantise(self.fmt, *quantise(self.fmt, x), x.dtype)

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots`` [B, K] as [B, kv_heads, K, head_dim] in ``dtype`` (one
        index_select each: the cheapest gather on CPU)."""
        flat = slots.reshape(-1)
        return tuple(
            self._read(pool.index_select(0, flat), scales, flat, dtype)
            .view(*slots.shape, *pool.shape[1:])
            .transpose(1, 2)
            for pool, scales in ((self.k, self.k_scale), (self.v, self.v_scale))
        )

    def span(self, first: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the consecutive slots [first, first + n) as [1, kv_heads, n, head_dim]
        (a view of the pool where it is stored in ``dtype``)."""
        return tuple(
            self._read(pool[first : first + n], scales, slice(first, first + n), dtype).transpose(0, 1).unsqueeze(0)
            for pool, scales in ((self.k, self.k_scale), (self.v, self.v_scale))
        )

    def _read(
        self, rows: torch.Tensor, scales: torch.Tensor | None, where: torch.Tensor | slice, dtype: torch.dtype
    ) -> torch.Tensor:
        if self.fmt is None:
            return rows if rows.dtype == dtype else rows.to(dtype)
        picked = scales[where] if isinstance(where, slice) else scales.index_select(0, where)
        return dequantise(self.fmt, rows, picked, dtype)
