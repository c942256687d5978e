"""The small ops between a decode step's linear layers as one native call each (``fused.cpp``):
transformers' RMSNorm, rotary embedding and declared activations, in the engine's decode steps
on CPU, eager and compiled.

Why, eager: a one-token step's linear layers stream their weights through the caches, and the
Python and dispatcher code of the ops between them then runs cold. Measured (2-core Xeon, 2
threads): the rotary embedding of a 16-head layer takes 32 us warm and 95-130 us right after a
4 MB weight has been read; an RMSNorm, about 8 ops, as much. One call instead of 8-16 made the
187M Llama's eager step 13% quicker (float32, int8 weights: 86 -> 97 tok/s, alternating in one
process), the 254M bfloat16 one 10% (60 -> 66).

Why, compiled: Inductor fuses a module's own code into kernels of its own, which round
otherwise (a reduction in another order, a bfloat16 product kept in float32): in bfloat16 the
compiled step's tokens parted from the eager step's within 15-60 tokens. Called as opaque ops,
the compiled step computes the eager step's numbers bit for bit, so that switching to it
mid-request changes no token.

A normalisation the native op does not take (a norm adding one to its weight, as Gemma's; a
``LayerNorm``; a class transformers does not declare) runs its own code in either step, called
in a compiled graph as one opaque op (``mm_pipeline::own_code``) for the same reason: Inductor
would sum its reduction in another order.

Which modules: those transformers itself declares interchangeable with a hub kernel (the
``kernels`` library's layer names: ``RMSNorm`` on the norm classes of 133 architectures,
``rotary_pos_emb`` among an attention class's kernel functions on 121, the ``SiLU``, ``GeluTanh``
and ``GeLU`` activation classes), with the weights and shapes the native ops read. Each native op
reproduces the module's arithmetic bit for bit, and a module class is trusted only once
``attach`` found its own forward and the op giving the same bits (a model whose norm adds one to
its weight, or whose rotation interleaves, stays on its own code). ``attach`` checks, on inputs
of its own, rather than a first call: a compiled step is traced before any step has run.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import weakref
from typing import Any, Callable

import torch

from pipeline.runner import matvec

NORM = "RMSNorm"  # transformers' kernel layer name for the standard RMSNorm
ROTARY = "rotary_pos_emb"  # transformers' kernel name of apply_rotary_pos_emb (an attention's ``_kernel_funcs``)
ACTIVATIONS = ("SiLU", "GeluTanh", "GeLU")  # kernel layer names ``mm_pipeline::activation`` computes, by index
DTYPES = (torch.float32, torch.bfloat16)
# a decode step's few tokens (16 of 8,192 features); more (a prefill) keeps PyTorch's parallel kernels
MAX_ELEMENTS = 1 << 17
# ATen's float sum takes vectors of 8 or 16 lanes (its build and the CPU): the check finds which
LANES = (8, 16)

# (class, dtype) -> the lanes of its sum (0 where none), or None: its own code gives other bits
_verdicts: dict[tuple[type, torch.dtype], int | None] = {}
# (class, dtype) -> whether its own forward gives one tensor like its input: then a compiled step
# calls it as one opaque op where the native ops do not apply (``_own``)
_opaque: dict[tuple[type, torch.dtype], bool] = {}
# handle -> a module whose own forward a compiled graph calls opaquely (``_own_code``). Handles
# count up as modules are attached: the same in every process loading the model alike, so that
# Inductor's caches (keyed by the graph, these constants in it) serve a second process too.
_modules: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_handles = itertools.count()


@torch.library.custom_op("mm_pipeline::own_code", mutates_args=())
def _own_code(x: torch.Tensor, module: int) -> torch.Tensor:
    """The module's own forward on ``x``, eager: one op Inductor calls as it is."""
    target = _modules[module]
    out = type(target).forward(target, x)
    return out.clone() if out is x else out  # a custom op's output may not alias its input


@_own_code.register_fake
def _(x: torch.Tensor, module: int) -> torch.Tensor:
    return torch.empty_like(x)  # a norm's or activation's output: its input's shape and dtype


def attach(model: torch.nn.Module) -> int:
    """Route the declared RMSNorm, rotary and activation modules of ``model`` through the native
    ops where they give the module's own bits (idempotent); returns how many modules are routed."""
    dtype = getattr(model, "dtype", None) or next((p.dtype for p in model.parameters()), torch.float32)
    routed = 0
    for module in model.modules():
        for target, route, own in _targets(module):
            if hasattr(target, "_hf_hook"):  # accelerate's placement wraps this forward: left as it is
                continue
            if not isinstance(target.__dict__.get("forward"), _Routed):
                target.forward = _Routed(route, target, own)
            if route is not _rotary and "_mm_own" not in target.__dict__:
                target._mm_own = next(_handles)  # what ``_own`` names it by in a compiled graph
                _modules[target._mm_own] = target
            _check(target, route, dtype)
            routed += 1
    return routed


def _targets(module: torch.nn.Module) -> list[tuple[torch.nn.Module, Callable, Callable]]:
    """(module, route, its own forward) for ``module`` and its declared kernel functions."""
    if _is_norm(module):
        return [(module, _norm, type(module).forward)]
    if getattr(type(module), "kernel_layer_name", None) in ACTIVATIONS:
        return [(module, _own if _python_formula(module) else _activation, type(module).forward)]
    if _is_other_norm(module):
        return [(module, _own, type(module).forward)]
    funcs = module.__dict__.get("_kernel_funcs") or {}
    found = [(f, _plain_function(type(f))) for name, f in funcs.items() if name == ROTARY]
    return [(f, _rotary, lambda _, *args, plain=plain, **kwargs: plain(*args, **kwargs)) for f, plain in found if plain]


def _is_other_norm(module: torch.nn.Module) -> bool:
    """A normalisation the native op does not take: PyTorch's ``LayerNorm`` or a model's own norm
    class (transformers names them ``...RMSNorm``, ``...LayerNorm``), one tensor in and out."""
    name = type(module).__name__
    return isinstance(module, torch.nn.LayerNorm) or (name.endswith(("RMSNorm", "LayerNorm")) and not _is_norm(module))


def _python_formula(module: torch.nn.Module) -> bool:
    """Whether an activation was built on transformers' Python formula (``use_gelu_python``,
    ``use_gelu_tanh_python``: a method of its own as ``act``), other bits than its class's check
    found on an instance calling PyTorch's kernel."""
    return inspect.ismethod(getattr(module, "act", None))


def _plain_function(func_class: type) -> Callable | None:
    """The function a ``kernels`` function module wraps (its forward's closure). Calling it, not
    the module, keeps a compiled step out of the module's dispatch back to this forward."""
    forward = getattr(func_class, "forward", None)
    names = getattr(getattr(forward, "__code__", None), "co_freevars", ())
    return forward.__closure__[names.index("func")].cell_contents if "func" in names else None


class _Routed:
    """A module's forward through ``route``. ``__func__`` is what the kernels library calls for
    a kernel function while compiling, with the function's shared module: the same route."""

    def __init__(self, route: Callable, module: torch.nn.Module, own: Callable) -> None:
        self.route, self.module, self.own = route, module, own
        self.__func__ = functools.partial(route, own)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.route(self.own, self.module, *args, **kwargs)


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
    """Inside the engine's steps with native kernels, on a dtype the ops read; eager, only a
    decode step's few values (a prefill keeps PyTorch's parallel kernels: the same bits)."""
    return (
        matvec.enabled()
        and x.device.type == "cpu"
        and x.dtype in DTYPES
        and (torch.compiler.is_compiling() or x.numel() <= MAX_ELEMENTS)
    )


def _norm(own: Callable, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    lanes = _verdicts.get((type(module), x.dtype))
    weight = module.weight
    if lanes is None or not _active(x) or weight.dtype != x.dtype or weight.shape[0] != x.shape[-1]:
        return _own(own, module, x)
    return torch.ops.mm_pipeline.rms_norm(x, weight, _eps(module), lanes)


def _activation(own: Callable, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if _verdicts.get((type(module), x.dtype)) is None or not _active(x):
        return _own(own, module, x)
    return torch.ops.mm_pipeline.activation(x, ACTIVATIONS.index(type(module).kernel_layer_name))


def _own(own: Callable, module: torch.nn.Module, x: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
    """The module's own code; in the engine's compiled step, as one opaque op (its eager bits)
    where ``attach`` found it gives one tensor of its input's shape and dtype."""
    opaque = torch.compiler.is_compiling() and _opaque.get((type(module), x.dtype), False)
    if rest or kwargs or not (opaque and _active(x)):
        return own(module, x, *rest, **kwargs)
    return torch.ops.mm_pipeline.own_code(x, module._mm_own)


def _rotary(
    own: Callable,
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *rest: Any,
    **kwargs: Any,
) -> Any:
    usable = _verdicts.get((type(module), q.dtype)) is not None
    if rest or kwargs or not usable or not _active(q) or not _rotary_shapes(q, k, cos, sin):
        return own(module, q, k, cos, sin, *rest, **kwargs)
    return torch.ops.mm_pipeline.rotary(q, k, cos, sin)


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


def _check(target: torch.nn.Module, route: Callable, dtype: torch.dtype) -> None:
    """Find, once per class and dtype, whether the native op gives the bits of ``target``'s own
    forward, and whether that forward gives one tensor like its input (``_opaque``), on random
    inputs shaped as a decode step's (outside ``matvec.active``: its own code)."""
    weight = getattr(target, "weight", None)
    if route is not _rotary and isinstance(weight, torch.Tensor):
        dtype = weight.dtype
    key = (type(target), dtype)
    native_wanted = route is not _own and key not in _verdicts  # does the native op give its bits?
    opaque_wanted = route is not _rotary and key not in _opaque  # may a compiled graph call it opaquely?
    if dtype not in DTYPES or not (native_wanted or opaque_wanted):
        return
    inputs, native, lanes = _sample(target, route, dtype)
    if not inputs:
        return
    with torch.inference_mode():
        try:
            expected = target(*inputs)
        except Exception:  # a norm by name whose forward takes other inputs: its own code, not opaque
            if route is not _own:
                raise
            _opaque[key] = False
            return
        if route is not _rotary:
            x = inputs[0]
            like = isinstance(expected, torch.Tensor) and expected.shape == x.shape
            _opaque[key] = like and expected.dtype == x.dtype
        if route is not _own:
            _verdicts[key] = next((n for n in lanes if _same(native(n, *inputs), expected)), None)


def _sample(target: torch.nn.Module, route: Callable, dtype: torch.dtype) -> tuple[tuple, Callable, tuple[int, ...]]:
    """(inputs, the native op taking lanes and them, the lanes to try) to check ``target`` on."""
    g = torch.Generator().manual_seed(0)  # its own: the caller's random state is left alone

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 3).to(dtype)

    if route is not _rotary:
        width = _width(target)
        inputs = (rand(2, width),) if width else ()
        if route is _norm:
            weight, eps = target.weight, _eps(target)
            return inputs, lambda n, x: torch.ops.mm_pipeline.rms_norm(x, weight, eps, n), LANES
        if route is _activation:
            kind = ACTIVATIONS.index(type(target).kernel_layer_name)
            return inputs, lambda n, x: torch.ops.mm_pipeline.activation(x, kind), (0,)
        return inputs, None, ()
    q, k = rand(1, 3, 4, 64).transpose(1, 2), rand(1, 3, 2, 64).transpose(1, 2)  # views, as attention makes them
    return (q, k, rand(1, 3, 64), rand(1, 3, 64)), lambda n, *args: torch.ops.mm_pipeline.rotary(*args), (0,)


def _width(module: torch.nn.Module) -> int | None:
    """The features a norm or activation takes (an activation any: 64), None where not known."""
    if getattr(type(module), "kernel_layer_name", None) in ACTIVATIONS:
        return 64
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return weight.shape[0]
    shape = getattr(module, "normalized_shape", None)
    return shape[-1] if isinstance(shape, tuple) and len(shape) == 1 else None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return isinstance(b, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
