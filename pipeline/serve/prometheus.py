"""``GET /metrics``: Prometheus text through ``prometheus_client``, one registry per server.

Request outcomes, tokens and latencies are recorded as requests end; the engine's state
(sequences, KV blocks, prefix-cache hits, preemptions) is read at scrape time.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pipeline.engine import Engine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineCollector:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

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


class ServerMetrics:
    def __init__(self, engine: Engine) -> None:
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
        r.register(_EngineCollector(engine))

    def finished(self, metrics: dict) -> None:
        self.prompt_tokens.inc(metrics.get("prompt_tokens") or 0)
        self.completion_tokens.inc(metrics.get("generated_tokens") or 0)
        if metrics.get("ttft_s") is not None:
            self.ttft.observe(metrics["ttft_s"])
        if metrics.get("tpot_s") is not None:
            self.tpot.observe(metrics["tpot_s"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
