"""The compiled decode step saved whole on CPU: a later process loads it instead of tracing the
model again.

Why: once Inductor's caches hold a step's graphs, what a second run still paid for its compiled
step was Dynamo tracing the model's Python, every process anew (4.6-6.3 s of a 254M Llama's
9-12 s warm-up on 2 cores). torch's ``aot_compile`` keeps what that trace made (the bytecode
that calls the graph, the compiled graph, the guards that pickle) in one file; loaded, the step
is ready in about 2 s (a 254M Llama's ``warmup_s``: 2.0-2.1 s against 9.1-10.6).

The model's own guards are dropped. They are thousands (every layer's modules and attributes
the trace read), and they do not pickle: a transformers class defined in a function, torchao's
layers, the pool's lock. What they would check is in the file's name instead (``_name``): the
compiled step's key (config, dtype, weight scheme, pool layout, torch and transformers), a
digest of the whole library's code, torchao's version, the instruction sets Inductor compiles
for on this CPU (``_vec_isa``), whether the native kernels and FlexAttention run, and
``structure``: every module's class, every parameter's, buffer's and pool tensor's shape, dtype
and kind. Kept: the guards on the step's own tensors (shape, strides, dtype) and on global
state, so a call the graph was not made for fails its check (``GuardMismatch``) and the caller
compiles it the usual way.

One file per kind of call: a single row (its own graph, as Dynamo specialises size 1), and two
rows and up (dynamic batch, table width and pool extent). Written whole or not at all, in
Inductor's cache folder (``inductor_cache.use_project_cache``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

from pipeline.runner import flex, matvec
from pipeline.runner.inductor_cache import source_digest, write_whole

FOLDER = "mm-pipeline-steps"
GUARD_FAILED = "GuardManager check failed"  # what a loaded step raises for a call it was not made for

logger = logging.getLogger(__name__)


class GuardMismatch(Exception):
    """A saved step was called with inputs unlike those it was compiled for."""


def supported() -> bool:
    """Whether this torch can save a compiled function (``aot_compile``, torch 2.10 and up)."""
    return hasattr(torch._dynamo.config, "enable_aot_compile")


class SavedStep:
    """``fn`` compiled with Inductor per kind of call, loaded from its file where one was saved,
    else compiled and saved in ``folder``. ``key_of(pool)``: the compiled step's key
    (``CompiledStep.key``)."""

    def __init__(self, fn: Callable, options: dict, key_of: Callable[[Any], str], folder: Path) -> None:
        self.fn = fn
        self.options = options
        self.key_of = key_of
        self.folder = folder / FOLDER  # in Inductor's cache folder
        self.loaded: dict[Path, Callable | None] = {}  # by file: None where it could not be made
        self._paths: dict[tuple, tuple[Path, weakref.ref, weakref.ref]] = {}  # by (kind, model, pool)

    def __call__(self, model: torch.nn.Module, pool: Any, *inputs: torch.Tensor) -> Any:
        """The step's outputs; ``GuardMismatch`` where no saved step fits (the caller compiles)."""
        path = self._path(model, pool, inputs)
        if path not in self.loaded:
            unsaved = path.with_suffix(".unsaved").exists()  # it failed before: not traced twice again
            self.loaded[path] = None if unsaved else _load(path) or self._compile(path, model, pool, inputs)
        step = self.loaded[path]
        if step is None:
            raise GuardMismatch("this step cannot be saved")
        try:
            return step(model, pool, *inputs)
        except RuntimeError as err:
            if str(err).startswith(GUARD_FAILED):
                raise GuardMismatch(str(err)[:200]) from None
            raise

    def _path(self, model: torch.nn.Module, pool: Any, inputs: tuple[torch.Tensor, ...]) -> Path:
        """The file of this kind of call on ``model`` and ``pool``, named once (hashing the
        model's structure each step would cost more than the guards it replaces)."""
        kind = "one" if inputs[3].shape[0] == 1 else "many"  # (the block tables: a row each)
        known = self._paths.get((kind, id(model), id(pool)))
        if known is not None and known[1]() is model and known[2]() is pool:
            return known[0]
        path = self.folder / f"{_name(self.key_of(pool), kind, model, pool)}.step"
        self._paths[(kind, id(model), id(pool))] = (path, weakref.ref(model), weakref.ref(pool))
        return path

    def _compile(self, path: Path, model: torch.nn.Module, pool: Any, inputs: tuple) -> Callable | None:
        """Compiled with ``aot_compile`` and saved; None where it cannot be (``CompiledStep``
        then compiles with ``torch.compile``, which needs no pickling), noted beside the file
        (``.unsaved``, with why) so that later processes trace it once, not twice."""
        with torch._dynamo.config.patch(enable_aot_compile=True):
            compiled = torch.compile(
                self.fn, backend="inductor", fullgraph=True, options={**self.options, "guard_filter_fn": _own_guards}
            )
        try:
            step = compiled.aot_compile(((model, pool, *inputs), {}))
        except Exception as err:  # dynamo raises many types: each means "cannot be saved"
            why = f"{type(err).__name__}: {str(err)[:200]}"
            logger.info("decode step not saved: %s", why)
            with contextlib.suppress(OSError):  # where the folder cannot be written, tried again next time
                path.parent.mkdir(parents=True, exist_ok=True)
                path.with_suffix(".unsaved").write_text(why + "\n")
            return None
        _save(step, path)
        return step


def _own_guards(entries: list) -> list[bool]:
    """Dynamo's guards a saved step keeps: global state, symbolic shapes, and the step's own
    tensor arguments (a bare name: ``ids``, not ``L['model'].layers[0]...``)."""
    return [
        e.guard_type in ("GLOBAL_STATE", "SHAPE_ENV") or (e.guard_type == "TENSOR_MATCH" and e.name.isidentifier())
        for e in entries
    ]


def _name(key: str, kind: str, model: torch.nn.Module, pool: Any) -> str:
    """What the dropped guards would check, hashed: the name a saved step's file is found by."""
    parts = [
        key,
        kind,
        structure(model, pool),
        library_code(),
        _version("torchao"),
        _vec_isa(),
        matvec.enabled(),
        flex.KERNEL.broken is None,  # (a step whose FlexAttention failed is traced without it)
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def structure(model: torch.nn.Module, pool: Any) -> str:
    """Every module's class and every tensor's name, shape, dtype and kind, the pool's included,
    hashed: a model of another architecture, size, dtype, scheme or shard has another."""
    digest = hashlib.sha256()
    for name, module in model.named_modules(remove_duplicate=False):
        digest.update(f"{name}:{type(module).__module__}.{type(module).__qualname__};".encode())
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    tensors += [(f"pool.{i}", t) for i, t in enumerate(pool.kv_tensors())]
    for name, t in tensors:
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{type(t).__qualname__}:{t.device.type};".encode())
    return digest.hexdigest()


@functools.cache
def library_code() -> str:
    """A digest of mm-pipeline's source (Python and the native kernels'): the saved bytecode is
    what the trace read of it, so another source is another step. The compile record's key
    (``CompiledStep.key``) takes the same digest: a wait measured for a step of other code (a
    trace of the new code, 6 s against a saved step's 1) must not decide whether to wait for this
    one, nor a step of other code count as built."""
    root = Path(__file__).resolve().parents[1]
    return source_digest(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h"))


@functools.cache
def _vec_isa() -> str:
    """The instruction sets Inductor builds this CPU's kernels for, with their compiler flags: torch's
    own CPU capability says "AVX512" alike on an AMX Xeon (kernels built with ``-mavx512bf16
    -mamx-bf16``) and on an AVX-512 CPU without bfloat16, which a step saved by the first must not
    reach through a shared cache folder."""
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    return f"{torch.backends.cpu.get_cpu_capability()} {type(isa).__name__} {isa.build_arch_flags()}"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _load(path: Path) -> Callable | None:
    """The step saved at ``path``; None where there is none, or it no longer loads (then removed,
    so that it is compiled and saved anew)."""
    try:
        with path.open("rb") as f:
            return torch.compiler.load_compiled_function(f)
    except FileNotFoundError:
        return None
    except Exception as err:  # a file of another torch, cut short, ...: compiled anew
        logger.info("saved decode step %s not loaded: %s: %s", path.name, type(err).__name__, str(err)[:200])
        path.unlink(missing_ok=True)
        return None


def _save(step: Any, path: Path) -> None:
    """``step`` written to ``path`` whole or not at all (another process may load it meanwhile);
    where it cannot be (an unpicklable part, an unwritable folder) the step still runs, unsaved."""
    try:
        data = type(step).serialize(step).serialized_data
        path.parent.mkdir(parents=True, exist_ok=True)
    except Exception as err:  # pickling raises many types
        logger.info("decode step not saved: %s: %s", type(err).__name__, str(err)[:200])
        return
    write_whole(path, data)
