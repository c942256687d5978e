"""One-token linear layers on CPU at the memory roofline (``matvec.cpp``), used by the engine's
steps where they apply, PyTorch's kernels everywhere else.

A single sequence's decode step multiplies one row by every weight matrix: memory-bound, and
PyTorch's CPU GEMMs reach about 60% of the bandwidth there (the kernel about 90%: docs/cpu-decode.md,
"Decode at the memory roofline"). The kernel is built on first use with
``torch.utils.cpp_extension`` (cached in torch's extensions folder, rebuilt when the source
changes) and registered as ``torch.ops.mm_pipeline.matvec``, which ``torch.compile`` calls as
an opaque op. Where it cannot apply (no AVX2, no compiler, another device, a weight it does not
read, more than one row of float weights) the layer runs as it always did; a failed build says
why once. int8 weights take the op for any number of rows: up to 16 each row is read through the
one-row kernel (a batch's row is computed exactly as alone), beyond that the op runs torchao's
own arithmetic. Why: torchao widens the whole int8 weight for every call of more than one row,
and a compiled step fused that widening into a copy of every weight per step (the 187M Llama:
0.11-0.19 s a step at batches 2-4 against 6 ms at one).

Only the engine's own forwards use it (``active``): ``generate()`` and every other call of the
model keep PyTorch's kernels, so comparisons against ``generate()`` stay honest. The same wrapper
runs the engine's eager bfloat16 products of 8 rows or more (prefill, batched decode) widened to
float32 on CPUs without native bfloat16 matmuls (``widens``), and on prepacked weights on CPUs
with them (``pipeline.runner.packed``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from pipeline.memory import available_ram, total_ram
from pipeline.runner import inductor_cache, packed

SOURCE = Path(__file__).with_name("matvec.cpp")
SOURCES = [
    SOURCE,
    SOURCE.with_name("decode_attention.cpp"),
    SOURCE.with_name("fused.cpp"),
]  # one extension, built and loaded together
HEADERS = [SOURCE.with_name("avx2.h")]  # included by both
# -fopenmp for at::parallel_for's threads (without it the kernel runs on one); the OpenMP symbols
# resolve to torch's own runtime, so torch.set_num_threads governs the kernel too.
# -ffp-contract=off: each product and sum of the scalar code rounded as written (the vector FMAs
# are explicit). GCC's default fuses ``v * scale + bias`` into one FMA in some copies of a loop
# and not in others (the one inlined where a single thread runs it, the one OpenMP's threads run),
# so an int8 row's last bit depended on the thread count; torchao rounds the product first. The
# norms and rotation of ``fused.cpp`` rely on it to round where ATen does.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off"]
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
# Smaller float weights are left to PyTorch: no memory-bound work to win, a few microseconds of call
# to lose. A model with none this large (the tiny test models, the embedded default) is left to
# PyTorch whole: the kernel not even built. Smaller int8 weights of a model the kernel serves take
# it too: compiled, torchao's widening and scaling of a small layer is fused by Inductor into
# other roundings than its eager call (bfloat16), and the compiled step must give the eager bits.
MIN_ELEMENTS = 1 << 17
# bfloat16 products of this many rows or more run widened to float32 (``widens``) or, on CPUs with
# native bfloat16 matmuls, on prepacked weights (``pipeline.runner.packed``)
MANY_ROWS = 8

_BUILD_LOCK = threading.Lock()
_built: list[str | None] = []  # [why not, or None], once the first load() has decided
_state = threading.local()  # .active: read by every wrapped linear, set around the engine's forwards (per thread)


class NativeFallback(UserWarning):
    """The native one-token kernel could not be built or loaded: PyTorch's kernels run."""


warnings.filterwarnings("ignore", category=NativeFallback, append=True)  # shown as one stderr line instead


def load() -> str | None:
    """Build (or load from the cache) and register the kernel, once per process (any thread);
    returns why not, or None when ``torch.ops.mm_pipeline.matvec`` is ready."""
    with _BUILD_LOCK:
        if not _built:
            _built.append(_build())
        return _built[0]


def _build() -> str | None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU has no AVX2 ({torch.backends.cpu.get_cpu_capability()})"
    # A CUDA build of torch logs at import that it finds no CUDA runtime: true on a CPU machine,
    # and beside the point for a CPU kernel (the line alarmed every CPU run of a real model).
    logging.getLogger("torch.utils.cpp_extension").addFilter(lambda r: "No CUDA runtime" not in str(r.msg))
    try:
        from torch.utils import cpp_extension

        # built once (about 10 s), then loaded from torch's extensions folder (about 0.3 s)
        cpp_extension.load(
            name=build_name(), sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS, is_python_module=False
        )
    except Exception as e:  # no compiler, no ninja, a failed build: PyTorch's kernels run
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        message = f"native matvec kernel unavailable ({reason}); linear layers use PyTorch's kernels"
        warnings.warn(message, NativeFallback, stacklevel=3)
        print(f"mm-pipeline: {message}", file=sys.stderr)
        return reason
    _register_fake()
    _amx[:] = [bool(torch.ops.mm_pipeline.matvec_amx(None))]
    return None


def build_name() -> str:
    """The extension's name in torch's cache, with a hash of its files (where they are and what
    they say) and flags.

    torch versions a build by its sources' text and its flags only: a changed header alone would
    load the stale build. And ninja rebuilds when a source's path changes, so under one name a
    source tree and an installed package rebuilt over each other (10-20 s) whenever they
    alternated: each copy has its own build now."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    for path in SOURCES + HEADERS:
        digest.update(str(path.resolve()).encode() + b"\0" + path.read_bytes())
    return f"mm_pipeline_kernels_{digest.hexdigest()[:12]}"


@functools.cache
def _register_fake() -> None:
    torch.library.register_fake("mm_pipeline::matvec")(_fake)  # output shapes, for torch.compile
    torch.library.register_fake("mm_pipeline::decode_attention")(_fake_attention)
    torch.library.register_fake("mm_pipeline::rows_as_alone")(lambda q, k, v, slots, mask, scale: torch.empty_like(q))
    torch.library.register_fake("mm_pipeline::rms_norm")(lambda x, weight, eps, lanes: x.new_empty(x.shape))
    torch.library.register_fake("mm_pipeline::rotary")(
        lambda q, k, cos, sin: (torch.empty_like(q), torch.empty_like(k))
    )
    torch.library.register_fake("mm_pipeline::activation")(lambda x, kind: torch.empty_like(x))


def _fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    laid_out: torch.Tensor | None = None,
    blocks: int = 1,
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _fake_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    return q.new_empty(q.shape)


def enabled() -> bool:
    """Whether the engine's native kernels run on this thread now (inside ``active(True)``)."""
    return getattr(_state, "active", False)


@contextlib.contextmanager
def active(on: bool = True) -> Iterator[None]:
    """The wrapped linears use the kernel inside this block, on this thread (the engine's model
    calls; ``generate()`` on another thread meanwhile keeps PyTorch's kernels)."""
    before = getattr(_state, "active", False)
    _state.active = on
    try:
        yield
    finally:
        _state.active = before


def plain_weights(module: torch.nn.Module, weight: Any = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight the kernel reads, row scales or None) of a linear layer (with ``weight`` in place of
    its own), or None where the kernel does not apply: float32 / bfloat16 weights, or torchao's
    weight-only int8 with one scale per row (its inner tensors); on CPU, contiguous,
    in_features a multiple of 16, float weights at least ``MIN_ELEMENTS`` of them."""
    weight = getattr(module, "weight", None) if weight is None else weight
    if not isinstance(module, torch.nn.Linear) or weight is None or weight.device.type != "cpu":
        return None
    scale = None
    if type(weight).__name__ == "Int8Tensor":  # torchao's Int8WeightOnlyConfig
        qdata, scale = weight.qdata, weight.scale
        if getattr(weight, "act_quant_kwargs", None) is not None or weight.block_size[-1] != qdata.shape[-1]:
            return None  # dynamic activation quantisation or per-group scales: torchao's path
        if getattr(weight, "act_pre_scale", None) is not None:
            return None  # activations pre-scaled (AWQ, SmoothQuant): torchao's path
        if getattr(weight, "zero_point", None) is not None and bool(weight.zero_point.any()):
            return None
        if scale.numel() != qdata.shape[0]:
            return None
        weight = qdata
    elif type(weight) not in (torch.Tensor, torch.nn.Parameter) or weight.dtype not in WEIGHT_DTYPES:
        return None
    if weight.dim() != 2 or weight.shape[1] % 16 or not weight.is_contiguous():
        return None
    if scale is None and weight.numel() < MIN_ELEMENTS:
        return None
    return weight.detach(), None if scale is None else scale.detach()


def attach(model: torch.nn.Module) -> int:
    """Wrap every linear layer the kernel can read (idempotent); returns how many are wrapped.
    A wrapped layer takes the kernel for one row of float32 / bfloat16 activations while
    ``active``, and its own forward otherwise.

    The layer's class becomes a subclass of its own whose forward is the wrapper
    (``_kernel_class``), so a compiled step reaches the layer by one path only. A wrapper held
    by the instance (as under accelerate's hooks, which keep the forward they call in
    ``_old_forward``) is guarded by Dynamo with all it holds: a 254M Llama's compiled step had
    11,700 guard nodes against 4,200, and its cached compile took 10.8 s against 8.6 s (means of
    four alternating runs; docs/cpu-decode.md)."""
    _watch_weights()
    wrapped = 0
    for module in model.modules():
        if "_mm_matvec" in module.__dict__:
            wrapped += 1
            continue
        found = plain_weights(module)
        if found is None:
            continue
        module.__dict__["_mm_matvec"] = [(*found, *bf16_reads(module))]  # replaced with it (``_weight_replaced``)
        name = "_old_forward" if hasattr(module, "_old_forward") else "forward"  # under accelerate's hooks
        if name in module.__dict__:  # a forward of the instance's own: wrapped where it is
            bound = getattr(module, name)
            setattr(module, name, functools.partial(_forward, lambda _, x: bound(x), module))
        else:
            module.__class__ = _kernel_class(type(module))
        wrapped += 1
    return wrapped


@functools.cache
def _kernel_class(base: type) -> type:
    """``base`` with its forward wrapped (``_forward``), under the same name (a model prints as
    before), pickled and copied as ``base`` itself (``_as_base``)."""

    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _forward(base.forward, self, x)

    return type(base.__name__, (base,), {"forward": forward, "__reduce_ex__": _as_base, "__module__": __name__})


def _as_base(self: torch.nn.Module, protocol: int) -> tuple:
    """A wrapped layer pickled (``torch.save``) or deep-copied as the plain layer it wraps: a class
    made here cannot be looked up by name, and a copy is attached anew where an engine runs it."""
    state = {k: v for k, v in self.__dict__.items() if k != "_mm_matvec"}
    return _plain_layer, (type(self).__bases__[0], state)


def _plain_layer(base: type, state: dict) -> torch.nn.Module:
    layer = base.__new__(base)
    layer.__setstate__(state)
    return layer


@functools.cache
def _watch_weights() -> None:
    torch.nn.modules.module.register_module_parameter_registration_hook(_weight_replaced)


def _weight_replaced(module: torch.nn.Module, name: str, param: Any) -> None:
    """A wrapped layer given a new weight reads that one from then on (or its own forward, where
    the kernel cannot read it). Tracked here rather than checked in every call: a compiled step
    would otherwise guard on the weight object, and guards on torchao's int8 tensor cost 0.5 ms a
    step (measured: 0.6 ms of guard checks against 0.1 without, the 187M Llama)."""
    reads = module.__dict__.get("_mm_matvec")
    if reads is not None and name == "weight":
        found = None if param is None else plain_weights(module, param)
        reads[0] = None if found is None else (*found, *bf16_reads(module, param))


def _forward(
    own: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor], module: torch.nn.Module, x: torch.Tensor
) -> torch.Tensor:
    """The kernel where it applies, else the layer's own forward, ``own(module, x)``.
    ``module._mm_matvec[0]``: what the kernel reads of the layer's weight (``plain_weights``), or None."""
    found = module._mm_matvec[0]
    if found is not None and enabled() and x.dtype in WEIGHT_DTYPES and x.device.type == "cpu":
        weight, scale, laid_out, blocks = found
        if scale is None:
            weight = module.weight  # read each call: an assignment to ``.data`` is seen too
        if blocks is None and x.dtype == torch.bfloat16:  # oneDNN's order unknown here: its own call
            return own(module, x)
        if x.numel() == x.shape[-1] or scale is not None:  # int8: any rows (the kernel picks how)
            return run(x, weight, scale, module.bias, laid_out, blocks)
        if torch.compiler.is_compiling():  # any row count (no guard on it, no graph per side of MANY_ROWS)
            usable = packed.usable(x, weight)
            return torch.ops.mm_pipeline.packed_linear(x, weight, module.bias) if usable else own(module, x)
        if x.numel() >= MANY_ROWS * x.shape[-1]:
            if packed.usable(x, weight):
                return packed.linear(x, weight, module.bias)
            if widens(x, weight):
                bias = None if module.bias is None else module.bias.float()
                return F.linear(x.float(), weight.float(), bias).to(x.dtype)
    return own(module, x)


def widens(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a bfloat16 product of many rows (``MANY_ROWS``) is faster widened to float32: on a
    CPU without native bfloat16 matmuls (no AVX-512 BF16 / AMX: oneDNN's bfloat16 path is off)
    PyTorch falls back to a generic loop, 4.7x slower than widening the weight and running
    float32's GEMM at 64 rows and already slower at 8 (measured: 1024x4096, 2 threads); below 8
    widening loses. Same arithmetic: float32 accumulation, one rounding to bfloat16. Eager steps
    only: a compiled graph would guard on the row count. (With native bfloat16 matmuls such
    products take prepacked weights instead: ``pipeline.runner.packed``.)"""
    return x.dtype == weight.dtype == torch.bfloat16 and not _native_bf16()


@functools.cache
def _native_bf16() -> bool:
    return packed.native_bf16()


def run(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    laid_out: torch.Tensor | None = None,
    blocks: int = 1,
) -> torch.Tensor:
    """``x @ weight.T (* scale) (+ bias)`` for one row ``x``, on the kernel (``load()`` first);
    bfloat16 rows on AMX read ``laid_out`` where given and sum in ``blocks`` (``bf16_reads``)."""
    return torch.ops.mm_pipeline.matvec(x, weight, scale, bias, laid_out, blocks)


LANE_ROWS = 128  # the rows of a group in the weights' copy for bfloat16 rows (matvec.cpp: lanes::ROWS)
MAX_BLOCKS = 8  # the most blocks oneDNN's split of a row is looked for in (seen: 1, 2, 4 and 6)
CALIBRATION_ELEMENTS = 1 << 30  # larger weights are not tried (the try widens one to bfloat16)
BLOCKS_FILE = "mm-pipeline-onednn-blocks.json"  # onednn_blocks' answers, in the project's cache folder


def bf16_reads(module: torch.nn.Module, weight: Any = None) -> tuple[torch.Tensor | None, int | None]:
    """(the weight laid out for the kernel's bfloat16 rows or None, the blocks oneDNN splits its
    rows into, or None where no split tried gave its bits) for a layer (``weight`` in place of its
    own). On a CPU with AMX (``amx``) a bfloat16 layer's rows (an int8 layer's of a bfloat16
    model) are summed in the order of oneDNN's AMX matmul, ``generate()``'s call
    (docs/cpu-decode.md, "bfloat16 on AMX"); a layer whose split was not found takes its own
    forward for bfloat16 rows, exact and slow. Elsewhere (None, 1): the row kernel's order."""
    weight = getattr(module, "weight", None) if weight is None else weight
    found = plain_weights(module, weight)
    if found is None or weight.dtype != torch.bfloat16 or found[0].shape[1] % 32 or not amx():
        return None, 1
    data = found[0]
    blocks = onednn_blocks(*data.shape, data.dtype, torch.get_num_threads())
    return (None if blocks is None else lanes(data)), blocks


def lanes(data: torch.Tensor) -> torch.Tensor | None:
    """``data`` [N, K] laid out [ceil(N / LANE_ROWS), K, LANE_ROWS], a column of a group's rows one
    stream, for the kernel's bfloat16 rows; None where RAM is short (a second copy of the weights,
    made only while ``packed.FLOOR`` of the RAM stays free): the tiles then sum in the same order
    on the weight as it is, 1.45x slower on the 254M Llama's int8 step."""
    if available_ram() - data.numel() * data.element_size() < packed.FLOOR * total_ram():
        _short_of_ram()
        return None
    n, k = data.shape
    groups = -(-n // LANE_ROWS)
    return F.pad(data, (0, 0, 0, groups * LANE_ROWS - n)).view(groups, LANE_ROWS, k).transpose(1, 2).contiguous()


@functools.cache
def _short_of_ram() -> None:
    print(
        "mm-pipeline: too little RAM for the weights' copy that bfloat16 decoding reads fastest (at least "
        f"{packed.FLOOR:.0%} of RAM stays free): one-token products run on the AMX tiles, slower, same results",
        file=sys.stderr,
    )


@functools.cache
def onednn_blocks(n: int, k: int, dtype: torch.dtype, threads: int) -> int | None:
    """Into how many blocks oneDNN's AMX matmul splits a bfloat16 row's columns for an [n, k]
    weight of ``dtype`` on ``threads`` threads (its heuristic's choice, unpublished; seen on 2
    threads: 1 up to K 4,096, then 2 to 8 by shape): ``find_blocks``' answer, kept in the
    project's cache folder (``BLOCKS_FILE``) per shape, thread count, torch (its oneDNN) and CPU,
    since finding it takes 0.1-4 s a shape (1-3 s of every load of the 254M Llama)."""
    key = f"{n}x{k} {dtype} {threads} threads, torch {torch.__version__}, {_cpu_name()}"
    inductor_cache.use_project_cache()
    known = inductor_cache.recall(BLOCKS_FILE)
    if key in known and (known[key] is None or isinstance(known[key], int)):
        return known[key]
    blocks = find_blocks(n, k, dtype)
    inductor_cache.keep(BLOCKS_FILE, key, blocks)
    return blocks


@functools.cache
def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "an unnamed CPU"


def find_blocks(n: int, k: int, dtype: torch.dtype) -> int | None:
    """``onednn_blocks`` found: 1 to MAX_BLOCKS tried on three inputs where orders part
    (``cancelling``), bit for bit against oneDNN's own call (the one torchao makes), on this
    process's threads. None where none gives its bits, or the weight is too large to try."""
    if n * k > CALIBRATION_ELEMENTS:
        return None
    scale = torch.ones(n, dtype=torch.bfloat16) if dtype == torch.int8 else None
    found = list(range(1, min(MAX_BLOCKS, k // 32) + 1))
    for seed in range(3):
        x, w = cancelling(n, k, seed)
        w = w.to(dtype)
        want = torch.mm(x, w.t().to(torch.bfloat16))
        found = [blocks for blocks in found if torch.equal(run(x, w, scale, None, None, blocks), want)]
    return found[0] if found else None


def cancelling(n: int, k: int, seed: int, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(bfloat16 rows x [rows, k], int8 weights [n, k]) on which sums in
    different orders part in about one output in ten: two columns of x are 2^14 and every row's
    weights there cancel, so what an output keeps of its other products depends on which of them
    shared a partial sum with the large ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    i, j = torch.randperm(k, generator=g)[:2].tolist()
    x[:, i] = x[:, j] = 2.0**14
    w[w[:, i] == 0, i] = 1
    w[:, j] = -w[:, i]
    return x.to(torch.bfloat16), w


def amx(force: bool | None = None) -> bool:
    """Whether bfloat16 rows are summed in the order of oneDNN's AMX matmul, ``generate()``'s
    (``bf16_reads``): where the CPU has AMX-BF16; ``force`` switches it off (the row kernel's
    order) or on where the CPU has it (tests, measurements). False where the kernel is not loaded."""
    if load() is not None:
        return False
    if force is not None or not _amx:
        _amx[:] = [bool(torch.ops.mm_pipeline.matvec_amx(force))]
    return _amx[0]


_amx: list[bool] = []  # matvec_amx's answer, read without an op call (the attention asks every layer)


def exact_bf16(x: torch.Tensor) -> bool:
    """Whether ``x``'s one-row products are summed as ``generate()``'s are, in bfloat16: then its
    decode attention must be ``generate()``'s call too (``attention.rows_as_alone``)."""
    return x.dtype == torch.bfloat16 and enabled() and bool(_amx) and _amx[0]


def isa(force: str | None = None) -> str:
    """The instruction set the kernel runs, "avx512" (where the CPU has AVX-512 F and BW) or "avx2";
    ``force`` switches to another the CPU has (tests, measurements). ``load()`` first."""
    return torch.ops.mm_pipeline.matvec_isa(force)


def ready(model: torch.nn.Module) -> bool:
    """Whether the engine's steps on ``model`` can use the kernel: some CPU weight of at least
    ``MIN_ELEMENTS`` it reads (those it reads are wrapped), and it builds (not even tried for a
    model with none, whose layers are then left unwrapped)."""
    large = any((found := plain_weights(m)) is not None and found[0].numel() >= MIN_ELEMENTS for m in model.modules())
    return large and attach(model) > 0 and load() is None
