"""The small ops between a decode step's linear layers as one native call each (``fused.cpp``):
transformers' RMSNorm and rotary embedding, in the engine's eager steps on CPU.

Why: a one-token step's linear layers stream their weights through the caches, and the Python
and dispatcher code of the ops between them then runs cold. Measured (2-core Xeon, 2 threads):
the rotary embedding of a 16-head layer takes 32 us warm and 95-130 us right after a 4 MB
weight has been read; an RMSNorm, about 8 ops, as much. One call instead of 8-16 made the 187M
Llama's eager step 13% quicker (float32, int8 weights: 86 -> 97 tok/s, alternating in one
process), the 254M bfloat16 one 10% (60 -> 66). The compiled step keeps the modules' own code:
Inductor fuses it anyway.

Which modules: those transformers itself declares interchangeable with a hub kernel (the
``kernels`` library's layer names: ``RMSNorm`` on the norm classes of 133 architectures,
``rotary_pos_emb`` among an attention class's kernel functions on 121), with the weights
and shapes the native ops read. Each native op reproduces the module's arithmetic bit for bit,
and a module class is trusted only after its first call here gave the same bits both ways (a
model whose norm adds one to its weight, or whose rotation interleaves, stays on its own code).
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.runner import matvec

NORM = "RMSNorm"  # transformers' kernel layer name for the standard RMSNorm
ROTARY = "rotary_pos_emb"  # transformers' kernel name of apply_rotary_pos_emb (an attention's ``_kernel_funcs``)
DTYPES = (torch.float32, torch.bfloat16)
# a decode step's few tokens (16 of 8,192 features); more (a prefill) keeps PyTorch's parallel kernels
MAX_ELEMENTS = 1 << 17
# ATen's float sum takes vectors of 8 or 16 lanes (its build and the CPU): the check finds which
LANES = (8, 16)

_verdicts: dict[tuple[type, torch.dtype], int | bool] = {}  # (class, dtype) -> lanes of its sum (0: none), or False


def attach(model: torch.nn.Module) -> int:
    """Route the declared RMSNorm and rotary modules of ``model`` through the native ops where
    they apply (idempotent); returns how many modules are routed."""
    routed = 0
    for module in model.modules():
        funcs = module.__dict__.get("_kernel_funcs") or {}
        targets = [module] if _is_norm(module) else []
        targets += [f for name, f in funcs.items() if name == ROTARY]
        for target in targets:
            if hasattr(target, "_hf_hook"):  # accelerate's placement wraps this forward: left as it is
                continue
            if not isinstance(target.__dict__.get("forward"), _Routed):
                target.forward = _Routed(_norm if target is module else _rotary, target)
            routed += 1
    return routed


class _Routed:
    """A module's forward through ``route``. Its ``__func__`` is the class's own forward: what
    the kernels library calls for a kernel function while compiling (read as
    ``forward.__func__``), so that a compiled step runs the module's own code."""

    def __init__(self, route: Any, module: torch.nn.Module) -> None:
        self.route, self.module = route, module
        self.__func__ = type(module).forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.route(self.module, *args, **kwargs)


def _is_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        getattr(type(module), "kernel_layer_name", None) == NORM
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and _eps(module) is not None
    )


def _eps(module: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _active(x: torch.Tensor) -> bool:
    """Inside the engine's eager steps with native kernels, on a decode step's few values of a
    dtype the ops read."""
    return (
        matvec.enabled()
        and not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype in DTYPES
        and x.numel() <= MAX_ELEMENTS
    )


def _norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    own = type(module).forward
    weight = module.weight
    if not _active(x) or weight.dtype != x.dtype or weight.shape[0] != x.shape[-1]:
        return own(module, x)
    eps = _eps(module)
    return _checked(
        (type(module), x.dtype),
        lambda: own(module, x),
        lambda lanes: torch.ops.mm_pipeline.rms_norm(x, weight, eps, lanes),
    )


def _rotary(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *rest: Any,
    **kwargs: Any,
) -> Any:
    own = type(module).forward
    if rest or kwargs or not _active(q) or not _rotary_shapes(q, k, cos, sin):
        return own(module, q, k, cos, sin, *rest, **kwargs)
    return _checked(
        (type(module), q.dtype),
        lambda: own(module, q, k, cos, sin),
        lambda lanes: torch.ops.mm_pipeline.rotary(q, k, cos, sin),
        lanes=(0,),
    )


def _rotary_shapes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """q, k [1, heads, tokens, dim] with cos, sin [1, tokens, dim] of their dtype: the layout the
    standard rotation takes by default (``unsqueeze_dim=1``), over the whole head."""
    return (
        q.dim() == k.dim() == 4
        and q.shape[0] == k.shape[0] == 1
        and q.shape[2:] == k.shape[2:]
        and q.shape[3] % 2 == 0
        and cos.shape == sin.shape == (1, q.shape[2], q.shape[3])
        and q.dtype == k.dtype == cos.dtype == sin.dtype
    )


def _checked(key: tuple[type, torch.dtype], own: Any, native: Any, lanes: tuple[int, ...] = LANES) -> Any:
    """``native(lanes)`` once ``key`` is known to give the bits of ``own()``; on the first call
    both run and the verdict is kept."""
    verdict = _verdicts.get(key)
    if verdict is False:
        return own()
    if verdict is not None:
        return native(verdict)
    expected = own()
    found = next((n for n in lanes if _same(native(n), expected)), None)
    _verdicts[key] = False if found is None else found  # threads racing here reach the same verdict
    return expected


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return isinstance(b, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
