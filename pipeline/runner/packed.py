"""Products of many bfloat16 rows on oneDNN's prepacked weights, on CPUs with native bfloat16
matmuls (AMX, AVX-512 BF16).

There PyTorch's bfloat16 ``F.linear`` is oneDNN's kernel, but it takes the weight in PyTorch's
row-major layout and reorders it into the kernel's blocks on every call: at 64 rows (a batched
decode step) that is about half the product's time. oneDNN also takes the weight reordered once
(``torch.ops.mkldnn._reorder_linear_weight``: the prepacking Inductor's freezing and vLLM's CPU
build do): 1.4-2.2x at 64-2048 rows (1024x4096, 2 threads; benchmarks/README.md, "Batched decode
on AMX"). The reordered copy is a second copy of the weight, so a layer gets one at its first such
product only while the RAM left stays above ``FLOOR`` of the machine's; it is kept beside the
weight (a weak map: it goes when the weight goes) and remade when the weight changes.
Arithmetic: float32 accumulation, one rounding to bfloat16, as unpacked (the order of the sums
may differ, as between any two GEMM kernels).
"""

from __future__ import annotations

import functools
import sys
import threading

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from pipeline.memory import available_ram, total_ram

FLOOR = 0.25  # of the machine's RAM, left available after a packed copy is made (else unpacked)
HINT_ROWS = 64  # oneDNN's batch-size hint for the packed layout (the engine's usual decode batch)

# weight -> ((its data pointer, version), packed copy or None): beside the weight, not on it or
# its module, so that copying the model (deepcopy) never meets oneDNN's opaque tensors
_PACKED = WeakIdKeyDictionary()
_LOCK = threading.Lock()


def native_bf16() -> bool:
    """Whether oneDNN's bfloat16 matmuls run on this CPU (AMX / AVX-512 BF16); False where PyTorch
    was built without oneDNN (read at import: never raises)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


SUPPORTED = (
    native_bf16()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")  # a plain bool: read
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)  # inside compiled graphs without breaking them


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` can run on a packed weight: bfloat16 both, on a CPU with native
    bfloat16 matmuls, where PyTorch has the packing ops."""
    return SUPPORTED and x.dtype == weight.dtype == torch.bfloat16 and weight.device.type == "cpu"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on ``weight``'s packed copy (made on first use) where there
    is one (not: too little RAM)."""
    packed = packed_copy(weight)
    if packed is None:
        return F.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


@torch.library.custom_op(
    "mm_pipeline::packed_linear", mutates_args=(), schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor"
)
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` as an op a compiled graph calls as it is (oneDNN's packed tensors cannot enter one)."""
    return linear(x, weight, bias)


@packed_linear.register_fake
def _fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of ``weight``, remade when it was changed in place (its version counter)
    or its data replaced; None where RAM is short (said once)."""
    key = (weight.data_ptr(), weight._version)
    with _LOCK:  # one copy made at a time (two engines' threads on one model: one copy, RAM counted once)
        kept = _PACKED.get(weight)
        if kept is not None and kept[0] == key:
            return kept[1]
        nbytes = weight.numel() * weight.element_size()
        packed = None
        if available_ram() - nbytes >= FLOOR * total_ram():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), HINT_ROWS)
        else:
            _say_once()
        _PACKED[weight] = (key, packed)
    return packed


@functools.cache
def _say_once() -> None:
    print(
        f"mm-pipeline: too little RAM for prepacked bfloat16 weights (a second copy; at least {FLOOR:.0%} of RAM "
        "stays free): some batched products use PyTorch's unpacked path",
        file=sys.stderr,
    )
