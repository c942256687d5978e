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
        for name, help_text in (("running", "sequences in flight"), ("waiting", "requests waiting for admission"),
                                ("kv_blocks_used", "KV blocks held"), ("kv_blocks_free", "KV blocks free or evictable")):
            yield GaugeMetricFamily(f"mm_{name}", help_text, value=stats[name])
        if "state_slots_free" in stats:  # models with linear-attention layers (recurrent states)
            yield GaugeMetricFamily("mm_state_slots_free", "recurrent-state slots free or evictable",
                                    value=stats["state_slots_free"])
        yield GaugeMetricFamily("mm_kv_bytes_per_token", "KV cache bytes a token takes (on each tensor-parallel rank)",
                                value=stats["kv_bytes_per_token"])
        yield GaugeMetricFamily("mm_tp_ranks", "tensor-parallel ranks (1: one process)", value=stats["tp_ranks"])
        if stats.get("tp_collective_share") is not None:
            yield GaugeMetricFamily("mm_tp_collective_share", "share of rank 0's step time in collectives (sampled)",
                                    value=stats["tp_collective_share"])
        yield CounterMetricFamily("mm_prefix_cache_hits", "full blocks taken from the prefix cache", value=pool.hits)
        yield CounterMetricFamily("mm_prefix_cache_lookups", "prefix-cache lookups", value=pool.lookups)
        yield CounterMetricFamily("mm_preemptions", "sequences preempted (recomputed later)",
                                  value=stats["preemptions"])


class ServerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mm_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("mm_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("mm_completion_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("mm_ttft_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("mm_tpot_seconds", "time per output token after the first", buckets=LATENCY_BUCKETS,
                              registry=r)
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
