"""The compiled decode step (``decode.compile=true``): the model's one-token forward over the paged
pool under ``torch.compile``, for every decode-only engine step.

gpt-fast's lesson: at small batch the decode step is bound by Python and kernel-launch overhead,
not by arithmetic; compiling the whole forward removes most of it. One function is compiled,
``forward.decode_step``: batch built, model run, logits and their argmax in one call. The
engine's decode bursts (greedy rows, nobody waiting) repeat it with the chosen token fed straight
back; any other decode-only step (sampled rows, requests waiting) takes its logits.

Fixed shapes: the batch and the block-table width are rounded up to buckets
(``forward.batch_bucket``, ``width_bucket``) and, on CPU, marked dynamic, so one graph serves every
bucket from 2 up (dynamo specialises size 1: batch 1 has its own); on CUDA each bucket is a
static graph (see ``_compile``). Masks and write slots are built inside the graph from tensors.
``Pipeline.warmup`` builds both graphs before the first request;
after it no batch size or context length recompiles (tests/test_compiled.py counts). On CPU
each graph is saved whole once compiled (``saved_step``): a later process loads it instead of
tracing the model again.

``decode.compile=auto`` (the command line's default, ``auto=True`` here): the graphs are built
ahead, on a thread beside the engine (``build``, on padding rows that write only the null block),
while the engine decodes eagerly; the runner takes the compiled step once they are ready
(``ready``), so no request waits for a first compile. Only on CPU with the native kernels
(``ModelRunner``): on CUDA the eager step replayed as CUDA graphs is the default's fast path, and
a model that cannot compile stays eager without a word.

On CUDA the default mode is ``reduce-overhead``: every bucket is captured as a CUDA graph, the
pool's tensors marked static (their address never changes: ``BlockPool`` allocates once), so a
replay writes the keys in place. A replay reuses its outputs' memory, so they are cloned before
the next one. Steps with prefill chunks run eagerly. Where the step cannot be compiled
(bitsandbytes weights, a compile error) the engine warns once (``FastPathFallback``) and stays
eager: the tokens are the same either way.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Sequence

import torch
import transformers

from pipeline.errors import UserError
from pipeline.kv import NULL_BLOCK, BlockPool
from pipeline.runner import flex, saved_step
from pipeline.runner.paged_batch import Chunk
from pipeline.runner.forward import burst_state, chunks_state, decode_logits, decode_step, greedy_steps
from pipeline.runner.guards import GUARDS, Seen
from pipeline.runner.saved_step import GuardMismatch, SavedStep
from pipeline.runner.inductor_cache import (
    CACHE_ENV,
    compile_record,
    failed_before,
    remember,
    remember_cached,
    use_project_cache,
)


# Why an auto step stays eager where its compile failed before (``inductor_cache.failed_before``:
# same model, torch and code): each run would spend that CPU beside the engine to fail again.
FAILED_BEFORE = "its compile failed here before (decode.compile=true tries again)"


class FastPathFallback(UserWarning):
    """``decode.compile`` was asked for but this model cannot use it: decoding is eager."""


# Shown by ``CompiledStep.fallback`` as one clean line; appended, so a user's own filter for it
# (``error``, ``always``, a ``catch_warnings`` record) still comes first.
warnings.filterwarnings("ignore", category=FastPathFallback, append=True)


def say_fallback(message: str) -> None:
    """A fast path's fallback, said once by its caller: one line on stderr, and a
    ``FastPathFallback`` warning (filters and ``catch_warnings`` see it; Python does not print it)."""
    warnings.warn(message, FastPathFallback, stacklevel=3)
    print(f"mm-pipeline: {message}", file=sys.stderr)


def compile_choice(value: Any) -> bool | str:
    """``decode.compile`` as given (a bool, or text from the command line or the
    ``MM_PIPELINE_COMPILE`` variable) as True, False or "auto"; ``UserError`` otherwise."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("auto", "true", "false"):
        return "auto" if text == "auto" else text == "true"
    raise UserError(f"decode.compile must be true, false or auto (got {value!r})")


class CompiledStep:
    """A compiled ``forward.forward`` for decode-only steps, falling back to eager on failure."""

    kind = "compiled"

    def __init__(self, backend: str = "inductor", mode: str | None = None, auto: bool = False) -> None:
        if not torch.cuda.is_available() and hasattr(torch._C, "_ensureCUDADeviceGuardSet"):
            # What dynamo's fake tensors do on first use where CUDA is absent, done here on the
            # creating thread: done first on a driving thread, a later compile on another
            # thread segfaults (torch 2.11 CUDA wheels on a CPU-only machine).
            torch._C._ensureCUDADeviceGuardSet()
        self.backend = backend
        self.mode = mode if backend == "inductor" else None  # modes are inductor options
        self.auto = auto  # decode.compile=auto: built ahead (``build``), used once ready, quiet where impossible
        self.ready = threading.Event()  # the runner takes this step only once set: at once unless auto
        self.builder: threading.Thread | None = None  # auto: the build beside the engine, once started
        if not auto:
            self.ready.set()
        use_project_cache()  # now: building the native kernel settles torch's default folder
        self.broken: str | None = None  # why compiling failed, once it did
        self.built_s: float | None = None  # what ``build`` took, once it built the graphs
        self._step: Any = None  # compiled decode_step
        self._warned = False
        self.shapes: set[tuple[int, int]] = set()  # (batch, keys) the compiled step has run at
        self._static: weakref.WeakSet = weakref.WeakSet()  # pools whose tensors CUDA graphs may keep

    def applies(self, device: torch.device) -> bool:
        """Whether the runner uses this step on ``device``: anywhere (Inductor has CPU and CUDA
        code); ``auto``, on CPU only (CUDA graphs are the default's fast path on a GPU)."""
        return not self.auto or device.type == "cpu"

    def why_not(self, lm: Any) -> str | None:
        """Why this model cannot take the compiled step (None: it can)."""
        if self.broken:
            return self.broken
        if getattr(lm, "recurrent", False):
            return "linear-attention layers (recurrent states) decode eagerly"
        quantizer = getattr(lm.model, "hf_quantizer", None)
        if quantizer is not None and not getattr(quantizer, "is_compileable", False):
            return f"{lm.quant} quantised weights ({type(quantizer).__name__}) cannot be compiled"
        return None

    def _settings(self, lm: Any) -> dict:
        """``mode`` as asked; on CUDA by default ``reduce-overhead`` (CUDA graphs); on CPU with
        inductor's default mode, its C++ wrapper: the Python wrapper around the generated
        kernels cost a third of a tiny model's step (measured: decode 2.9x -> 3.5-3.9x
        ``generate()``, warm-up 17 -> 21 s)."""
        if self.mode is None and self.backend == "inductor":
            if lm.device.type == "cuda":
                return {"mode": "reduce-overhead"}
            if lm.device.type == "cpu":
                return {"options": {"cpp_wrapper": True}}
        return {"mode": self.mode}

    def graphs(self, lm: Any) -> bool:
        """Whether the compiled step replays CUDA graphs (its outputs must then be cloned)."""
        return (
            self.backend == "inductor"
            and lm.device.type == "cuda"
            and self._settings(lm).get("mode") in ("reduce-overhead", "max-autotune")
        )

    def fallback(self, reason: str) -> None:
        """Say once, in one line on stderr, why decoding stays eager; also raised as a
        ``FastPathFallback`` warning, which Python does not print (its two-line file:line form
        would repeat the line) but filters and ``catch_warnings`` still see."""
        if not self._warned and not self.auto:  # auto asked for nothing: it stays eager quietly
            self._warned = True
            say_fallback(f"decode.compile: {reason}; decoding uncompiled")

    def __call__(
        self, lm: Any, pool: BlockPool, chunks: Sequence[Chunk], device: torch.device | None = None
    ) -> torch.Tensor:
        """Next-token logits [rows, V] of decode rows (one token each), compiled, at bucketed shapes."""
        device = device if device is not None else lm.device
        state = chunks_state(pool, chunks, device, bucketed=self.why_not(lm) is None)
        pool.prepare_write()
        logits = self._run(
            lambda step: step(lm.model, pool, *state)[3], lambda: decode_logits(lm.model, pool, *state), lm, pool
        )
        return logits[: len(chunks)]

    def greedy_steps(self, lm: Any, pool: BlockPool, state: tuple[torch.Tensor, ...], steps: int) -> list[torch.Tensor]:
        """``forward.greedy_steps`` (a decode burst) on the compiled ``decode_step``."""
        return self._run(
            lambda step: greedy_steps(lm.model, pool, state, steps, step=step),
            lambda: greedy_steps(lm.model, pool, state, steps),
            lm,
            pool,
        )

    def build(self, lm: Any, pool: BlockPool, rows: int | None = None) -> float:
        """Compile now the graphs a step of ``rows`` sequences takes (None: any number; batch 1 has
        a graph of its own, 2 and up share one), then set ``ready``; returns the seconds taken.

        Safe beside an engine decoding eagerly on the same pool: the steps run on padding rows
        (token 0 at position 0, all-null block tables), which write only the null block that
        every real row masks out. Each graph runs two steps, the second fed the first's
        outputs, as a burst does. Call under ``torch.inference_mode()`` and ``matvec.active``
        as the engine's steps are (their guards must match). A failure leaves the step
        ``broken`` (the engine stays eager) and still sets ``ready``."""
        t0 = time.perf_counter()
        key = self.key(lm, pool, rows)
        record = compile_record(key)
        cached = "first_s" in record  # Inductor will find the graphs in its caches
        if self.auto and failed_before(record):
            self.broken = FAILED_BEFORE
        try:
            able = self.why_not(lm) is None
            if able:
                with GUARDS.checking():  # (no other thread's step skips guards while these trace)
                    self._build_graphs(lm, pool, rows)
            seconds = time.perf_counter() - t0
            if self.why_not(lm) is None:
                self.built_s = seconds
                if cached:
                    remember_cached(key, seconds)
                else:
                    remember(key, first_s=seconds)
            elif able:  # it failed compiling: auto does not try again (``FAILED_BEFORE``)
                remember(key, failed_s=seconds)
            return seconds
        except BaseException:  # cut short (``compile_ahead.CompileCancelled``): no half-built step
            self.broken = self.broken or "the compile was cut short"
            raise
        finally:
            self.ready.set()

    def _build_graphs(self, lm: Any, pool: BlockPool, rows: int | None) -> None:
        """Two steps on padding rows for each graph ``build`` makes (``rows``: as there)."""
        for batch in (1,) if rows == 1 else (1, 3):
            state = padding_state(pool, batch, lm.family.position_rows, lm.device)
            pool.prepare_write()
            self._run(lambda step: greedy_steps(lm.model, pool, state, 2, step=step), lambda: None, lm, pool)

    def key(self, lm: Any, pool: BlockPool, rows: int | None) -> str:
        """What the graphs ``build`` makes depend on (the model's shapes and dtype, its weight
        scheme, the pool's size and layout, the batch sizes, torch and mm-pipeline), hashed: the key under
        which ``inductor_cache.compile_record`` says whether Inductor's caches hold them."""
        # (not the path it was loaded from, nor what attaching the paged attention notes in it)
        config = {k: v for k, v in lm.model.config.to_dict().items() if not k.startswith(("_", "transformers"))}
        parts = {
            "config": config,
            "dtype": str(pool.dtype),
            "quant": str(getattr(lm, "quant", None)),
            # (the pool's size too: its tensors' shapes are the graphs', so another size compiles anew)
            "pool": [pool.num_blocks, pool.block_size, pool.kv_dtype, str(pool.attention), pool.window],
            "rows": rows == 1,
            "step": [self.backend, self.mode, lm.device.type],
            "code": [torch.__version__, transformers.__version__, saved_step.library_code()],
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()

    def _run(self, compiled_call: Any, eager_call: Any, lm: Any, pool: BlockPool) -> Any:
        """``compiled_call(compiled decode_step)``; ``eager_call()`` where compiling is impossible or
        failed (the calls are functional over the pool's slots: rerunning one rewrites the same
        slots). A failure with FlexAttention in the graph first retries the compile without it."""
        reason = self.why_not(lm)
        if reason is not None:
            self.fallback(reason)
            return eager_call()
        if self._step is None:
            self._step = self._compile(decode_step, lm)
        try:
            return compiled_call(self._step)
        except Exception as err:  # dynamo/inductor raise many types; all mean "cannot compile this"
            if flex.usable(pool, lm.device):
                flex.KERNEL.fail(err)
                self._step = None
                return self._run(compiled_call, eager_call, lm, pool)
            first_line = (str(err).strip().splitlines() or [""])[0][:200]
            self.broken = f"torch.compile failed ({type(err).__name__}: {first_line})"
            self.fallback(self.broken)
            return eager_call()

    def _compile(self, fn: Any, lm: Any) -> Any:
        """``fn`` compiled, called with its batch and key dimensions marked dynamic; under CUDA
        graphs, each call a new graph step with its outputs cloned (the next replay reuses their
        memory)."""
        # On CUDA every bucket is a graph of static shapes (a CUDA graph each under reduce-overhead
        # anyway): FlexAttention's decoding kernel failed Inductor's lowering under dynamic shapes there.
        static = lm.device.type == "cuda"
        if static:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, flex.STATIC_GRAPHS)
        compiled = torch.compile(
            flex.own_code(fn), backend=self.backend, dynamic=False if static else None, **self._settings(lm)
        )
        graphs = self.graphs(lm)
        seen = Seen()  # the kinds of call whose guards passed (``guards``)
        saved = self._saved(fn, lm)

        def step(model: Any, pool: BlockPool, *inputs: torch.Tensor) -> Any:
            tables = inputs[3]
            self.shapes.add((tables.shape[0], tables.shape[1] * pool.block_size))  # (batch, keys): one CUDA graph each
            if not static:
                _mark_dynamic(*inputs)
            if saved is not None:
                try:
                    return saved(model, pool, *inputs)
                except GuardMismatch:  # a call of a kind no saved step fits: compiled below
                    pass
            if not graphs:
                return GUARDS.call(compiled, seen, model, pool, inputs)
            if pool not in self._static:
                for t in pool.kv_tensors():
                    torch._dynamo.mark_static_address(t)
                self._static.add(pool)
            torch.compiler.cudagraph_mark_step_begin()
            out = GUARDS.call(compiled, seen, model, pool, inputs)
            return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()

        return step

    def _saved(self, fn: Any, lm: Any) -> SavedStep | None:
        """``fn`` compiled once and saved for later processes (``saved_step``), on CPU with
        Inductor's default mode; not under tensor parallelism (each rank's graph holds its
        process group)."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed or not saved_step.supported() or lm.device.type != "cpu":
            return None
        folder = os.environ.get(CACHE_ENV)  # (``use_project_cache`` named it, where it could)
        if self.backend != "inductor" or self.mode is not None or not folder:
            return None
        options = self._settings(lm)["options"]
        return SavedStep(flex.own_code(fn), options, lambda pool: self.key(lm, pool, None), Path(folder))


def padding_state(pool: BlockPool, rows: int, position_rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A decode step's inputs (``burst_state``, bucketed) for ``rows`` padding rows alone."""
    return burst_state(
        pool, [0] * rows, [[0] * rows] * position_rows, [0] * rows, [[NULL_BLOCK]] * rows, 1, device, bucketed=True
    )


def _mark_dynamic(
    ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, tables: torch.Tensor, extent: torch.Tensor
) -> None:
    """The batch, table width and pool extent vary between calls: one graph for every bucket from
    2 up, instead of a recompile at the second size seen (size 1 stays specialised: its own graph)."""
    for t, dims in (
        (ids, (1,)),
        (positions, (positions.dim() - 1,)),
        (lengths, (0,)),
        (tables, (0, 1)),
        (extent, (0,)),
    ):
        for d in dims:
            if t.shape[d] >= 2:
                torch._dynamo.maybe_mark_dynamic(t, d)
