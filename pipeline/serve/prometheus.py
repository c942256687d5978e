"""``GET /metrics``: Prometheus text through ``prometheus_client``, one registry per server.

Two sets of names: this project's own (``mm_*``), and vLLM's (``vllm:*``, with vLLM's types,
buckets and ``model_name`` label) so that dashboards made for vLLM work unchanged.

Request outcomes, tokens and latencies are recorded as requests end; the engine's state
(sequences, KV blocks, prefix-cache hits, preemptions) is read at scrape time.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from typing import Any, Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from pipeline.engine import Engine
from pipeline.memory import text_config
from pipeline.serve.protocol import FINISH

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_GAP_BUCKETS = (  # inter-token latency and time per output token
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (  # end to end, queue, prefill, decode, inference
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
VLLM_LABELS = ("model_name", "engine")  # engine: vLLM's engine-core index, always "0" here
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's finished_reason values


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's token-count buckets (its max_model_len)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


def context_length(engine: Engine) -> int:
    """The longest sequence the engine takes: the model's context (as the engine's limit check
    reads it), else what the KV pool holds."""
    config = getattr(getattr(getattr(engine, "runner", None), "lm", None), "config", None)
    length = getattr(text_config(config), "max_position_embeddings", None) if config is not None else None
    if length:
        return int(length)
    pool = engine.pool
    return max(1, (pool.num_blocks - 1) * pool.block_size)


class _EngineCollector:
    def __init__(self, engine: Engine, vllm: VllmMetrics | None = None) -> None:
        self.engine = engine
        self.vllm = vllm

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        pool = self.engine.pool
        for name, help_text in (
            ("running", "sequences in flight"),
            ("waiting", "requests waiting for admission"),
            ("kv_blocks_used", "KV blocks held"),
            ("kv_blocks_free", "KV blocks free or evictable"),
        ):
            yield GaugeMetricFamily(f"mm_{name}", help_text, value=stats[name])
        if "state_slots_free" in stats:  # models with linear-attention layers (recurrent states)
            yield GaugeMetricFamily(
                "mm_state_slots_free", "recurrent-state slots free or evictable", value=stats["state_slots_free"]
            )
        yield GaugeMetricFamily(
            "mm_kv_bytes_per_token",
            "KV cache bytes a token takes (on each tensor-parallel rank)",
            value=stats["kv_bytes_per_token"],
        )
        yield GaugeMetricFamily("mm_tp_ranks", "tensor-parallel ranks (1: one process)", value=stats["tp_ranks"])
        yield GaugeMetricFamily(
            "mm_decode_compiled",
            "1 once decode steps run compiled (decode.compile; auto: built beside the engine), else 0",
            value=float(stats["decode_compiled"]),
        )
        if stats["decode_compile_s"] is not None:
            yield GaugeMetricFamily(
                "mm_decode_compile_seconds",
                "what building the compiled decode step beside the engine took (decode.compile=auto)",
                value=stats["decode_compile_s"],
            )
        if stats.get("tp_collective_share") is not None:
            yield GaugeMetricFamily(
                "mm_tp_collective_share",
                "share of rank 0's step time in collectives (sampled)",
                value=stats["tp_collective_share"],
            )
        yield CounterMetricFamily("mm_prefix_cache_hits", "full blocks taken from the prefix cache", value=pool.hits)
        yield CounterMetricFamily("mm_prefix_cache_lookups", "prefix-cache lookups", value=pool.lookups)
        yield CounterMetricFamily(
            "mm_preemptions", "sequences preempted (recomputed later)", value=stats["preemptions"]
        )
        yield from _tier_metrics(stats)
        if self.vllm is not None:
            yield from self.vllm.collect(stats)
            yield from lora_info(self.engine)


def lora_info(engine: Engine) -> Iterator[Metric]:
    """vLLM's ``vllm:lora_requests_info``: the adapters running and waiting as labels, the scrape
    time as value; only while adapters are loaded or in flight (vLLM: only with LoRA enabled).
    ``max_lora``: the adapters loaded, all of which may share a step here."""
    running, waiting = engine.adapters_in_flight()
    loaded = len(engine.runner.lm.adapters)
    if not (loaded or running or waiting):
        return
    family = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    family.add_metric([str(loaded), ",".join(waiting), ",".join(running)], time.time())
    yield family


TIER_METRICS = (  # kv.offload's second tier: (stats key, metric, help, counter?)
    ("blocks", "mm_kv_tier_blocks", "KV blocks held in the second tier", False),
    ("bytes", "mm_kv_tier_bytes", "bytes the second tier holds", False),
    ("hits", "mm_kv_tier_hits", "blocks loaded back from the second tier instead of recomputed", True),
    ("misses", "mm_kv_tier_misses", "second-tier reads that found no usable block", True),
    ("stores", "mm_kv_tier_stores", "blocks written to the second tier", True),
    ("refused", "mm_kv_tier_refused", "tier files refused (corrupt, or another model's)", True),
    ("bytes_loaded", "mm_kv_tier_loaded_bytes", "bytes loaded back from the second tier", True),
    ("load_s", "mm_kv_tier_load_seconds", "seconds spent loading blocks from the second tier", True),
)


def _tier_metrics(stats: dict) -> Iterator[Metric]:
    """The second tier's figures (``kv.offload``), labelled by tier; none without one."""
    if "kv_tier_tier" not in stats:
        return
    for key, name, help_text, counter in TIER_METRICS:
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, help_text, labels=["tier"])
        family.add_metric([stats["kv_tier_tier"]], stats[f"kv_tier_{key}"])
        yield family


class _Repeated:
    """A histogram whose one observation may stand for several equal ones: a sequence's mean gap
    between tokens, once per gap (vLLM observes each gap; a result carries their mean)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, times: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += times  # the first bucket whose le >= value
        self.sum += value * times

    def family(self, name: str, help_text: str, labels: list[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, help_text, labels=list(VLLM_LABELS))
        buckets, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            buckets.append((floatToGoString(bound), total))
        family.add_metric(labels, buckets, self.sum)
        return family


class VllmMetrics:
    """vLLM's metric names, types, buckets and labels (``model_name``, ``engine``), from the same
    figures as the ``mm_*`` ones: per sequence as it ends, the engine's state at scrape time."""

    def __init__(
        self, registry: CollectorRegistry, model_name: str, max_model_len: int, aborted: Callable[[], float]
    ) -> None:
        self.labels = [model_name, "0"]
        self.aborted = aborted  # calls cancelled so far (vLLM's finished_reason "abort")
        self.lock = threading.Lock()
        self.finished = dict.fromkeys(FINISHED_REASONS, 0)  # abort: read from ``aborted`` at scrape time
        self.gaps = _Repeated(TOKEN_GAP_BUCKETS)

        def counter(name: str, help_text: str) -> Any:
            return Counter(name, help_text, VLLM_LABELS, registry=registry).labels(*self.labels)

        def histogram(name: str, help_text: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, help_text, VLLM_LABELS, buckets=buckets, registry=registry).labels(*self.labels)

        tokens = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.request_max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_GAP_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

    def observe(self, metrics: dict, finish_reason: str) -> None:
        """One sequence ended: its tokens, outcome and times. vLLM's phases from this project's
        figures: queue = submission -> first scheduled (``queue_s``), prefill = scheduled -> first
        token, decode = first token -> end, end to end = submission -> end (``total_s``)."""
        prompt = int(metrics.get("prompt_tokens") or 0)
        generated = int(metrics.get("generated_tokens") or 0)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.cache_queries.inc(prompt)
        self.cache_hits.inc(int(metrics.get("kv_reused_tokens") or 0))
        self.request_prompt.observe(prompt)
        self.request_generation.observe(generated)
        self.request_max_generation.observe(generated)
        with self.lock:
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
            if metrics.get("tpot_s") is not None and generated > 1:
                self.gaps.observe(metrics["tpot_s"], generated - 1)
        ttft, total, queue = metrics.get("ttft_s"), metrics.get("total_s"), metrics.get("queue_s") or 0.0
        if ttft is not None:
            self.ttft.observe(ttft)
        self.request_tpot.observe(metrics["tpot_s"] if metrics.get("tpot_s") is not None else 0.0)
        if total is None:
            return
        first = ttft if ttft is not None else total  # nothing generated: all of it was prefill
        self.e2e.observe(total)
        self.queue.observe(queue)
        self.inference.observe(max(0.0, total - queue))
        self.prefill.observe(max(0.0, first - queue))
        self.decode.observe(max(0.0, total - first))

    def collect(self, stats: dict) -> Iterator[Metric]:
        """The scrape-time figures (the engine's ``stats``) and those kept here."""
        labels = self.labels

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, help_text, labels=list(VLLM_LABELS))
            family.add_metric(labels, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats["running"])
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats["waiting"])
        total = stats["kv_blocks_total"]
        usage = min(1.0, max(0.0, 1.0 - stats["kv_blocks_free"] / total)) if total > 0 else 0.0
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            usage,
        )
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels=list(VLLM_LABELS)
        )
        preemptions.add_metric(labels, stats["preemptions"])
        yield preemptions
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*VLLM_LABELS, "finished_reason"],
        )
        with self.lock:  # a consistent copy: the families are made inside, yielded after
            finished = {**self.finished, "abort": self.aborted()}
            gaps = [
                self.gaps.family(
                    "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels
                ),
                self.gaps.family(
                    "vllm:time_per_output_token_seconds",
                    "Histogram of time per output token in seconds."
                    "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                    labels,
                ),
            ]
        for reason, count in finished.items():
            success.add_metric([*labels, reason], count)
        yield success
        yield from gaps


class ServerMetrics:
    """The server's registry: ``mm_*`` and vLLM's names. ``model_name``: the served id (vLLM's
    ``model_name`` label); ``max_model_len``: the top of the token-count buckets (None: the model's
    context)."""

    def __init__(self, engine: Engine, model_name: str = "mm-pipeline", max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mm_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("mm_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("mm_completion_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("mm_ttft_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            "mm_tpot_seconds", "time per output token after the first", buckets=LATENCY_BUCKETS, registry=r
        )
        self.vllm = VllmMetrics(r, model_name, max_model_len or context_length(engine), self._cancelled)
        r.register(_EngineCollector(engine, self.vllm))

    def finished(self, metrics: dict, finish_reason: str | None = None) -> None:
        """One sequence ended (``finish_reason``: the engine's, as ``Result.finish_reason``)."""
        self.prompt_tokens.inc(metrics.get("prompt_tokens") or 0)
        self.completion_tokens.inc(metrics.get("generated_tokens") or 0)
        if metrics.get("ttft_s") is not None:
            self.ttft.observe(metrics["ttft_s"])
        if metrics.get("tpot_s") is not None:
            self.tpot.observe(metrics["tpot_s"])
        self.vllm.observe(metrics, FINISH.get(finish_reason, "stop"))

    def _cancelled(self) -> float:
        """Calls cancelled so far (status 499: the client went away), from ``mm_requests``."""
        return sum(
            sample.value
            for family in self.requests.collect()
            for sample in family.samples
            if sample.name == "mm_requests_total" and sample.labels.get("status") == "499"
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
