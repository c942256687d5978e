"""Per-stage timing and counters, and the figures derived from them (the names are a contract).

Memory is measured per engine step (``note_step``, called by the engine after each model step):
the device's peak since the previous step (the CUDA allocator's, or the process's resident set on
CPU), less the KV pool, which is one fixed allocation reported apart (``kv_pool_bytes``). Each
request keeps the largest figure of the steps it took part in, so requests that overlap each get
their own peak, and no request resets what another is measuring.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from pipeline.memory import stored_bytes


def _is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued accelerator work so that wall time measures the work, not its launch."""
    if _is_cuda(device):
        torch.cuda.synchronize(device)


def decode_weight_bytes(model: torch.nn.Module, encoders: Sequence[str] = ()) -> int:
    """Bytes of weights one decode step reads: the language model, lm_head included; not the
    media encoders (``encoders``: the family's ``encoder_modules``, run once per image or clip)
    nor the input embedding table (one row per token) unless it is tied to lm_head. The
    numerator of an honest ``bandwidth_gb_s``."""
    encoders = frozenset(encoders)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = set()
    if emb is not None and (out is None or out.weight is not emb.weight):
        skip.add(id(emb.weight))
    total = 0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if id(tensor) in skip or encoders.intersection(name.split(".")):
            continue
        skip.add(id(tensor))  # tied / shared tensors count once
        total += stored_bytes(tensor)
    return total


def peak_memory_bytes(device: torch.device | str | None) -> int:
    """The process's peak so far: CUDA allocator peak, or peak RSS on CPU (pool included)."""
    if _is_cuda(device):
        return int(torch.cuda.max_memory_allocated(device))
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)


_HWM = re.compile(rb"VmHWM:\s+(\d+) kB")


def _rss_window_peak() -> int | None:
    """Linux: peak resident bytes since the last call (VmHWM), then reset to the current RSS
    (``5`` written to /proc/self/clear_refs resets the high-water mark, nothing else). None
    where /proc cannot do it: the caller falls back to the lifetime peak."""
    try:
        with open("/proc/self/status", "rb") as f:
            match = _HWM.search(f.read())
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def window_peak(device: torch.device | str | None) -> int:
    """Peak bytes on ``device`` since the previous call, the window restarted: host-side reads of
    the CUDA allocator's counters (no synchronisation), or of the process's RSS on CPU."""
    if _is_cuda(device):
        peak = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    peak = _rss_window_peak()
    return peak if peak is not None else peak_memory_bytes(device)


def pool_bytes(pool: Any) -> int:
    """Bytes the KV pool's tensors take (keys/values on every device, recurrent-state slots);
    0 before its first forward allocates them. On CPU the pages count only once touched."""
    stores = pool.stores  # one tensor per device, every layer's keys and values
    total = sum(t.numel() * t.element_size() for t in stores)
    states = getattr(pool, "states", None)
    if states is not None and stores:
        total += states.num_slots * states.slot_bytes
    return total


def _pool_in_peak(pool: Any, device: torch.device | str | None, allocated: int) -> int:
    """The part of the pool inside a measured peak: all of it on CUDA (allocated up front); on
    CPU the blocks held now (pages of blocks never handed out are not resident)."""
    if _is_cuda(device):
        return allocated
    return min(allocated, pool.used_blocks * pool.block_bytes)


def note_step(metrics: Sequence["Metrics"], contexts: Sequence[int], pool: Any, steps: int = 1) -> None:
    """After one engine model step (``steps`` > 1: a greedy decode burst) over rows whose
    attention read ``contexts`` keys each (at the step's first token): every row's request
    records the step's peak memory without the pool, the pool's size, and the KV bytes the step
    read (all rows', as a device reads them; ``bandwidth_gb_s``)."""
    if not metrics:
        return
    device = metrics[0].device
    allocated = pool_bytes(pool)
    peak = max(0, window_peak(device) - _pool_in_peak(pool, device, allocated))
    per_token = pool.block_bytes / pool.block_size
    rows = len(contexts)
    keys = steps * sum(contexts) + rows * steps * (steps - 1) // 2  # a burst's rows grow by one key a step
    for m in metrics:
        m.note_memory(peak, allocated)
        m.step_kv_read = keys * per_token / steps


def reset_window(device: torch.device | str | None) -> None:
    """Start a fresh measuring window (an engine about to run its first step: the weights'
    loading peak is no request's)."""
    window_peak(device)


class Metrics:
    """Records one request. Spans nest: a parent's seconds exclude its children's (sample vs decode)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self.stages: dict[str, dict[str, float]] = {}
        self.counters: dict[str, float] = {}
        self.info: dict[str, object] = {}
        self._child_seconds: list[float] = []
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.memory_peak: int | None = None  # largest step peak without the pool (note_step)
        self.pool_bytes: int | None = None
        self.step_kv_read = 0.0  # KV bytes the last noted step read, per step (note_step)
        self.kv_read_bytes = 0.0  # over this request's decode steps

    # --- events -----------------------------------------------------------------------------
    def start(self) -> None:
        """The request is submitted. Host-only (no synchronisation, no device call): the server
        calls it on its event loop, and a peak reset here would break overlapping requests."""
        self.t_start = time.perf_counter()

    def note_memory(self, peak: int, pool: int) -> None:
        """One step this request took part in: its peak without the pool, and the pool's bytes."""
        self.memory_peak = peak if self.memory_peak is None else max(self.memory_peak, peak)
        self.pool_bytes = pool

    def first_token(self) -> None:
        """Called once the first generated token is chosen (its value already on the host)."""
        if self.t_first is None:
            self.t_first = time.perf_counter()

    def end(self) -> None:
        synchronize(self.device)
        self.t_end = time.perf_counter()

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Device-synchronised wall time of a block, added to stages[name]."""
        synchronize(self.device)
        t0 = time.perf_counter()
        self._child_seconds.append(0.0)
        try:
            yield
        finally:
            synchronize(self.device)
            total = time.perf_counter() - t0
            self._record(name, total - self._child_seconds.pop(), 1, enclosing=total)

    def add_span(self, name: str, seconds: float, calls: int) -> None:
        """Record time measured without ``span`` (e.g. per-step sampling timed with CUDA events,
        which needs no host sync); like a nested span, it is taken out of the enclosing span.
        A ``decode`` step also adds the KV bytes that step read (``note_step``)."""
        self._record(name, seconds, calls, enclosing=seconds)
        if name == "decode":
            self.kv_read_bytes += self.step_kv_read * calls

    def _record(self, name: str, seconds: float, calls: int, *, enclosing: float) -> None:
        """Add to stages[name]; ``enclosing`` seconds are taken out of the open parent span."""
        rec = self.stages.setdefault(name, {"seconds": 0.0, "calls": 0})
        rec["seconds"] += seconds
        rec["calls"] += calls
        if self._child_seconds:
            self._child_seconds[-1] += enclosing

    def count(self, name: str, value: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + value

    def set(self, name: str, value: float) -> None:
        self.counters[name] = value

    # --- derived figures --------------------------------------------------------------------
    def seconds(self, stage: str) -> float:
        return self.stages.get(stage, {}).get("seconds", 0.0)

    def to_dict(self) -> dict:
        c = self.counters
        out: dict = {"stages": {k: dict(v) for k, v in self.stages.items()}}
        generated = int(c.get("generated_tokens", 0))
        out["prompt_tokens"] = int(c.get("prompt_tokens", 0))
        out["prefill_tokens"] = int(c.get("prefill_tokens", 0))
        out["kv_reused_tokens"] = int(c.get("kv_reused_tokens", 0))
        out["generated_tokens"] = generated
        out["decode_tokens"] = int(c.get("decode_tokens", 0))
        out["total_s"] = _sub(self.t_end, self.t_start)
        out["ttft_s"] = _sub(self.t_first, self.t_start)
        out["tpot_s"] = (
            (self.t_end - self.t_first) / (generated - 1)
            if generated > 1 and self.t_end is not None and self.t_first is not None
            else None
        )
        out["prefill_tok_s"] = _rate(out["prefill_tokens"], self.seconds("prefill"))
        # Drafting (speculative decoding) is part of what a decoded token costs.
        out["decode_tok_s"] = _rate(out["decode_tokens"], self.seconds("decode") + self.seconds("draft"))
        if "spec_drafted" in c:  # speculative decoding: drafts proposed and kept, tokens per target forward
            drafted, accepted = int(c["spec_drafted"]), int(c.get("spec_accepted", 0))
            out["spec_drafted"] = drafted
            out["spec_accepted"] = accepted
            out["spec_accept_rate"] = accepted / drafted if drafted else None
            steps = self.stages.get("decode", {}).get("calls", 0)
            out["spec_tokens_per_step"] = out["decode_tokens"] / steps if steps else None
        out["sample_s"] = self.seconds("sample")
        if "megapixels" in c:  # images and video frames: vision_mp_s counts both
            out["megapixels"] = c["megapixels"]
            out["vision_mp_s"] = _rate(c["megapixels"], self.seconds("vision_encoder"))
        if "video_frames" in c:  # videos the encoder saw: sampled frames, seconds of source they span
            out["video_frames"] = int(c["video_frames"])
            out["video_seconds"] = c.get("video_seconds", 0.0)
        if "audio_seconds" in c:
            out["audio_seconds"] = c["audio_seconds"]
            out["audio_rtf"] = _rate(self.seconds("audio_encoder"), c["audio_seconds"])
        for key in ("image_tokens", "video_tokens", "audio_tokens"):
            if key in c:
                out[key] = int(c[key])
        out["kv_cache_bytes"] = int(c.get("kv_cache_bytes", 0))
        # Without the pool, over the steps this request was in (no step noted: the process's peak).
        out["peak_memory_bytes"] = self.memory_peak if self.memory_peak is not None else peak_memory_bytes(self.device)
        if self.pool_bytes is not None:
            out["kv_pool_bytes"] = self.pool_bytes
        weights = c.get("weights_bytes")
        if weights is not None:
            out["weights_bytes"] = int(weights)
            read = c.get("decode_weights_bytes", weights)  # what a decode step reads (no encoders)
            out["decode_weights_bytes"] = int(read)
            out["bandwidth_gb_s"] = self._bandwidth(read)
        if "grammar_s" in c:  # constrained decoding: this request's share of masking and accepting
            out["grammar_s"] = c["grammar_s"]
        if "queue_s" in c:  # engine: submission -> first scheduled (ttft_s counts from submission)
            out["queue_s"] = c["queue_s"]
        # engine: times the request's blocks were taken back and recomputed (always reported, 0 when none)
        out["preemptions"] = int(c.get("preemptions", 0))
        if "oom_retries" in c:  # engine: steps it was in that ran out of device memory and were retried smaller
            out["oom_retries"] = int(c["oom_retries"])
        if "warmup_s" in c:  # one-off compile/tuning before the first request: never part of ttft_s
            out["warmup_s"] = c["warmup_s"]
        out.update(self.info)
        return out

    def _bandwidth(self, weights: float) -> float | None:
        """GB/s the decode steps read: the decode weights once per step plus every row's keys
        and values (``kv_read_bytes``), over the decode steps' seconds."""
        rec = self.stages.get("decode", {})
        seconds, steps = rec.get("seconds", 0.0), rec.get("calls", 0)
        if seconds <= 0 or not steps:
            return None
        return (weights * steps + self.kv_read_bytes) / seconds / 1e9


def _sub(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def _rate(amount: float, seconds: float) -> float | None:
    return amount / seconds if seconds > 0 else None


def format_table(metrics: dict) -> str:
    """A compact two-column table for stderr: stages first, then the derived figures."""
    rows: list[tuple[str, str]] = []
    for name, rec in metrics.get("stages", {}).items():
        rows.append((f"{name} (s)", f"{rec['seconds']:.4f}  x{int(rec['calls'])}"))
    for key, value in metrics.items():
        if key == "stages" or value is None or isinstance(value, (dict, list)):
            continue
        rows.append((key, _fmt(key, value)))
    width = max(len(k) for k, _ in rows) if rows else 0
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _fmt(key: str, value: object) -> str:
    if isinstance(value, (int, float)) and key.endswith("_bytes"):
        value = int(value)
        return f"{value:,} ({value / 2**20:.1f} MiB)"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
