"""The eager decode step replayed as CUDA graphs (``decode.cuda_graphs``, on by default on CUDA).

At small batch a decode step is bound by the host, not the GPU: the model's own Python launches
hundreds of small kernels a token (Qwen2-VL-2B on an H100: 27 ms of Python a token, eager). A CUDA
graph records those launches once and replays them in one call. As nano-vllm does: one graph per
shape bucket (batch ``forward.batch_bucket`` x block-table width ``forward.width_bucket``),
captured the first time that bucket runs, on static input buffers, every graph of a runner
sharing one memory pool; a step copies its inputs into its bucket's buffers and replays. No
Inductor: a capture costs about two eager steps, where ``decode.compile``'s warm-up did not end
in 170 s on the GPU. ``decode.compile`` stays for Inductor (its own CUDA graphs, fused kernels).

What capture needs, and ``forward.decode_step`` provides: every shape fixed by the bucket, no host
read and no host-built tensor inside the step (write slots and masks come from the input
tensors), the pool's tensors at a fixed address (``BlockPool`` allocates once). The captured
function also feeds its chosen tokens, positions and lengths back into the input buffers, so a
greedy burst is one replay a token. Capture runs on padding inputs (token 0, an all-null block
table): it writes into the null block only.

A replay runs no Python: hooks on the model run when a bucket is captured, never again. So a
model with hooks (accelerate's offloading, user hooks) decodes eagerly, said once.

``cpu_stand_in`` is what the tests capture with on CPU: it records the step's ATen calls and
replays them with their arguments frozen as a CUDA graph freezes them, refusing host reads, so a
step that would go wrong under capture goes wrong on CPU too (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.kv import NULL_BLOCK, BlockPool
from pipeline.runner.paged_batch import Chunk
from pipeline.runner.compiled import say_fallback
from pipeline.runner.forward import chunks_state, decode_logits, decode_step, greedy_steps

Capture = Callable[[Callable[[], torch.Tensor], Any], tuple[Any, torch.Tensor]]


def cuda_capture(fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Any, torch.Tensor]:
    """(graph, output) of ``fn`` captured on the current CUDA device after one warm-up run on a
    side stream (lazy initialisation, cuBLAS workspaces and compiled kernels happen there, not in
    the capture). ``pool``: the memory pool the runner's graphs share."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


@dataclass
class Bucket:
    """One captured bucket: its input buffers (ids, positions, lengths, tables, extent), the
    logits buffer the graph writes, and the graph."""

    inputs: tuple[torch.Tensor, ...]
    logits: torch.Tensor
    graph: Any

    def load(self, state: Sequence[torch.Tensor]) -> None:
        for buffer, value in zip(self.inputs, state):
            if buffer.numel():  # (the extent carries no data, only its length)
                buffer.copy_(value, non_blocking=True)


class GraphedStep:
    """``forward.decode_step`` captured per bucket and replayed (see the module docstring).
    Offers what ``CompiledStep`` offers the model runner: ``why_not``, a call for one step's
    logits, ``greedy_steps`` for a burst. ``capture``: how a bucket is captured (``cuda_capture``;
    the tests' ``cpu_stand_in``)."""

    kind = "cuda graphs"

    def __init__(self, capture: Capture | None = None) -> None:
        self.capture = capture
        self.broken: str | None = None  # why capturing failed, once it did
        self.buckets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pool -> {shapes: Bucket}
        self._memory: Any = None  # the graphs' shared memory pool
        self._warned = False
        self._refused: dict[int, str | None] = {}  # id(model) -> why its step cannot be captured

    def applies(self, device: torch.device) -> bool:
        """Whether the runner uses this step on ``device``: CUDA (or a test's stand-in anywhere)."""
        return device.type == "cuda" or self.capture is not None

    def why_not(self, lm: Any) -> str | None:
        """Why this model's decode step is not replayed (None: it is)."""
        if self.broken:
            return self.broken
        if getattr(lm, "recurrent", False):
            return "linear-attention layers (recurrent states) decode eagerly"
        if getattr(lm, "tp", 1) > 1:
            return "tensor-parallel ranks decode eagerly (their collectives are not captured)"
        key = id(lm.model)
        if key not in self._refused:
            self._refused[key] = _hooked(lm.model)
        return self._refused[key]

    def fallback(self, reason: str) -> None:
        """Say once, in one line on stderr, why decoding is not replayed (also a ``FastPathFallback``)."""
        if not self._warned:
            self._warned = True
            say_fallback(f"decode.cuda_graphs: {reason}; decoding eagerly")

    def __call__(
        self, lm: Any, pool: BlockPool, chunks: Sequence[Chunk], device: torch.device | None = None
    ) -> torch.Tensor:
        """Next-token logits [rows, V] of decode rows (one token each), replayed at their bucket."""
        device = device if device is not None else lm.device
        state = chunks_state(pool, chunks, device, bucketed=True)
        pool.prepare_write()
        bucket = self._bucket(lm, pool, state)
        if bucket is None:
            return decode_logits(lm.model, pool, *state)[: len(chunks)]
        bucket.load(state)
        bucket.graph.replay()
        return bucket.logits[: len(chunks)].clone()  # the next replay writes over the buffer

    def greedy_steps(self, lm: Any, pool: BlockPool, state: tuple[torch.Tensor, ...], steps: int) -> list[torch.Tensor]:
        """``forward.greedy_steps``: each replay feeds its chosen ids back into the input buffers."""
        bucket = self._bucket(lm, pool, state)
        if bucket is None:
            return greedy_steps(lm.model, pool, state, steps)
        bucket.load(state)
        chosen = []
        for _ in range(steps):
            bucket.graph.replay()
            chosen.append(bucket.inputs[0].clone())
        return chosen

    def _bucket(self, lm: Any, pool: BlockPool, state: Sequence[torch.Tensor]) -> Bucket | None:
        """The bucket of ``state``'s shapes, captured on first use; None where the step cannot be
        (said once: decoding goes on eagerly, with the same tokens)."""
        reason = self.why_not(lm)
        if reason is None:
            buckets = self.buckets.setdefault(pool, {})
            key = tuple(tuple(t.shape) for t in state)
            bucket = buckets.get(key)
            if bucket is not None:
                return bucket
            try:
                buckets[key] = bucket = self._capture(lm, pool, state)
                return bucket
            except Exception as err:  # capture raises many types; all mean "this step cannot be replayed"
                first_line = (str(err).strip().splitlines() or [""])[0][:200]
                self.broken = reason = f"capturing the decode step failed ({type(err).__name__}: {first_line})"
        self.fallback(reason)
        return None

    def _capture(self, lm: Any, pool: BlockPool, state: Sequence[torch.Tensor]) -> Bucket:
        """Buffers shaped like ``state``, holding padding rows, and the step captured over them."""
        ids, positions, lengths, tables, extent = state
        inputs = (
            torch.zeros_like(ids),
            torch.zeros_like(positions),
            torch.ones_like(lengths),
            torch.full_like(tables, NULL_BLOCK),
            torch.empty_like(extent),
        )
        model = lm.model

        def step() -> torch.Tensor:
            chosen, next_positions, next_lengths, logits = decode_step(model, pool, *inputs)
            inputs[0].copy_(chosen)
            inputs[1].copy_(next_positions)
            inputs[2].copy_(next_lengths)
            return logits

        if self._memory is None and self.capture is None:
            self._memory = torch.cuda.graph_pool_handle()
        graph, logits = (self.capture or cuda_capture)(step, self._memory)
        return Bucket(inputs, logits, graph)


def _hooked(model: torch.nn.Module) -> str | None:
    """Why hooks on ``model`` rule replay out (a replay runs none of them), or None."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "global module hooks are registered (a replay would not run them)"
    for name, m in model.named_modules():
        if hasattr(m, "_hf_hook"):
            return f"accelerate hooks on {name or 'the model'} (offloaded or split weights) move weights every step"
        if m._forward_hooks or m._forward_pre_hooks:
            return f"forward hooks on {name or 'the model'} (a replay would not run them)"
    return None


# --- the CPU stand-in the tests capture with ------------------------------------------------------

# ATen calls that read the device from the host or build their output's shape from its data: a
# CUDA graph cannot capture them (capture fails, or a replay keeps the capture's values).
HOST_READS = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::is_nonzero",
    "aten::equal",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::lift_fresh",
    "aten::lift_fresh_copy",
}
MASK_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}  # boolean: nonzero


class HostRead(RuntimeError):
    """A step captured by ``cpu_stand_in`` read the device from the host (or built a tensor from host data)."""


class _Recorder(TorchDispatchMode):
    """Records every ATen call with its arguments and outputs; refuses ``HOST_READS``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any, list[bool]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        if name in HOST_READS or (
            name in MASK_INDEXING and any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1:2]))
        ):
            raise HostRead(f"{name} inside the decode step: a CUDA graph cannot capture it")
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out, _aliases(out, args, kwargs)))
        return out


class CpuGraph:
    """A CUDA graph's semantics on CPU: ``replay`` reruns the recorded ATen calls with the very
    arguments they were recorded with (Python numbers frozen, tensors by identity) and writes each
    fresh output into the recorded one's memory, as a graph's kernels write into fixed addresses."""

    def __init__(self, calls: list[tuple[Any, tuple, dict, Any, list[bool]]]) -> None:
        self.calls = calls
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, out, aliased_outputs in self.calls:
            fresh = func(*args, **kwargs)
            for recorded, new, aliased in zip(_flat(out), _flat(fresh), aliased_outputs):
                if aliased or not isinstance(recorded, torch.Tensor):
                    continue  # a view of (or in place on) an argument: already up to date
                if recorded.shape != new.shape:
                    raise HostRead(
                        f"{func._schema.name} gave shape {tuple(new.shape)} on replay, "
                        f"{tuple(recorded.shape)} at capture: its shape depends on data"
                    )
                recorded.copy_(new)


def cpu_stand_in(fn: Callable[[], torch.Tensor], pool: Any) -> tuple[CpuGraph, torch.Tensor]:
    """``cuda_capture`` on CPU: one warm-up run, then ``fn`` recorded (its effects happen once,
    as a capture's do not; the step is functional over its slots, so that is harmless)."""
    fn()
    recorder = _Recorder()
    with recorder:
        out = fn()
    return CpuGraph(recorder.calls), out


def _flat(value: Any) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _aliases(out: Any, args: tuple, kwargs: dict) -> list[bool]:
    """Per flattened output: whether it shares memory with an argument (a view, an in-place
    result, ``to`` returning its input): such outputs follow their argument on replay. Read off
    the tensors, not the schema: ``to`` may alias or copy."""
    held = {t.untyped_storage().data_ptr() for t in _tensors(args) + _tensors(list(kwargs.values()))}
    return [isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in held for o in _flat(out)]


def _tensors(values: Any) -> list[torch.Tensor]:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            found += _tensors(v)
    return found
