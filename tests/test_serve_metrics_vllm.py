"""``GET /metrics`` under vLLM's names (beside the ``mm_*`` ones): vLLM's types, buckets and
``model_name`` label, figures that add up to the responses' usage, and every ``vllm:`` name the
Grafana dashboard in deploy/grafana queries exported."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from pipeline.serve.prometheus import REQUEST_LATENCY_BUCKETS, TOKEN_GAP_BUCKETS, TTFT_BUCKETS
from serving import serving

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "mm-pipeline.json"
MODEL = "vllm-names-test"

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)
HISTOGRAMS = {  # name: vLLM's bucket boundaries (None: 1-2-5 up to the context length)
    "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
    "vllm:time_per_output_token_seconds": TOKEN_GAP_BUCKETS,
    "vllm:inter_token_latency_seconds": TOKEN_GAP_BUCKETS,
    "vllm:request_time_per_output_token_seconds": TOKEN_GAP_BUCKETS,
    "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_inference_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_prompt_tokens": None,
    "vllm:request_generation_tokens": None,
    "vllm:request_max_num_generation_tokens": None,
}
# What vLLM's example dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries,
# its V0-era and current versions together; vllm:num_requests_swapped and vllm:cpu_cache_usage_perc
# (V0 only: nothing is swapped to the CPU here, and vLLM's V1 engine exports neither) are left out.
VLLM_EXAMPLE_DASHBOARD = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_sum",
    "vllm:request_time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
PER_TOKEN = {"vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"}  # one per gap


def dashboard_names(dashboard: dict) -> set[str]:
    """The ``vllm:`` metric names the dashboard's queries use, ``_bucket``/``_sum``/``_count``
    of a histogram read as the histogram."""
    exprs: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    exprs.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard)
    return {m for expr in exprs for m in re.findall(r"vllm:[a-zA-Z0-9_:]+", expr)}


def exported(families: dict) -> set[str]:
    """Every sample name the scrape has (``vllm:prompt_tokens_total``, ``..._bucket``)."""
    return {sample.name for family in families.values() for sample in family.samples}


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """Two chat requests through the openai client (one to its end of sequence, one to its
    max_tokens: the embedded default ends at once unless told to ignore it), then one scrape."""
    tmp = tmp_path_factory.mktemp("serve-vllm-metrics")
    with serving(tmp, f"serve.model_name={MODEL}") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        answers = [
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=5, extra_body=extra
            )
            for text, extra in (("Count to three.", {"ignore_eos": True}), ("Name a colour.", None))
        ]
        text = httpx.get(server.url + "/metrics").text
    return answers, {f.name: f for f in text_string_to_metric_families(text)}, text


def samples(family, suffix: str = "") -> list:
    return [s for s in family.samples if s.name == family.name + suffix]


def test_every_vllm_name_with_its_type_and_the_model_label(scraped):
    _, families, text = scraped
    for name, kind in [
        *((n, "gauge") for n in GAUGES),
        *((n, "counter") for n in COUNTERS),
        *((n, "histogram") for n in HISTOGRAMS),
    ]:
        assert name in families, name
        family = families[name]
        assert family.type == kind, (name, family.type)
        assert family.samples and all(s.labels["model_name"] == MODEL for s in family.samples), name
    assert "mm_requests_total{" in text and "mm_ttft_seconds_bucket" in text  # the own names stay
    assert re.search(r'^vllm:prompt_tokens_total\{engine="0",model_name="%s"\} ' % MODEL, text, re.M)


def test_histograms_have_vllms_buckets_and_count_the_finished_requests(scraped):
    answers, families, _ = scraped
    gaps = sum(max(0, a.usage.completion_tokens - 1) for a in answers)
    for name, bounds in HISTOGRAMS.items():
        family = families[name]
        les = [s.labels["le"] for s in samples(family, "_bucket")]
        assert les[-1] == "+Inf", name
        if bounds is not None:
            assert [float(le) for le in les[:-1]] == [float(b) for b in bounds], name
        else:
            assert [float(le) for le in les[:3]] == [1.0, 2.0, 5.0], name
        (count,) = samples(family, "_count")
        assert count.value == (gaps if name in PER_TOKEN else len(answers)), name
        counts = [s.value for s in samples(family, "_bucket")]
        assert counts == sorted(counts) and counts[-1] == count.value, name  # cumulative


def test_token_counters_equal_the_usage(scraped):
    answers, families, _ = scraped
    (prompt,) = samples(families["vllm:prompt_tokens"], "_total")
    (generated,) = samples(families["vllm:generation_tokens"], "_total")
    assert prompt.value == sum(a.usage.prompt_tokens for a in answers) > 0
    assert generated.value == sum(a.usage.completion_tokens for a in answers) > 0
    (prompt_sum,) = samples(families["vllm:request_prompt_tokens"], "_sum")
    assert prompt_sum.value == prompt.value
    (queries,) = samples(families["vllm:prefix_cache_queries"], "_total")
    (hits,) = samples(families["vllm:prefix_cache_hits"], "_total")
    assert queries.value == prompt.value
    assert hits.value == sum(a.usage.prompt_tokens_details.cached_tokens for a in answers)


def test_outcomes_and_engine_state(scraped):
    answers, families, _ = scraped
    success = {s.labels["finished_reason"]: s.value for s in samples(families["vllm:request_success"], "_total")}
    assert set(success) == {"stop", "length", "abort"}
    expected = {"stop": 0, "length": 0, "abort": 0}
    for answer in answers:
        expected[answer.choices[0].finish_reason] += 1
    assert success == expected == {"stop": 1, "length": 1, "abort": 0}
    (usage,) = samples(families["vllm:kv_cache_usage_perc"])
    assert 0.0 <= usage.value <= 1.0
    (running,) = samples(families["vllm:num_requests_running"])
    (waiting,) = samples(families["vllm:num_requests_waiting"])
    assert running.value == 0 and waiting.value == 0  # every request answered
    (e2e,) = samples(families["vllm:e2e_request_latency_seconds"], "_sum")
    (ttft,) = samples(families["vllm:time_to_first_token_seconds"], "_sum")
    assert e2e.value >= ttft.value > 0
    (gaps,) = samples(families["vllm:inter_token_latency_seconds"], "_sum")
    figures = [a.model_extra["metrics"] for a in answers]
    expected_gaps = sum((m["tpot_s"] or 0) * (m["generated_tokens"] - 1) for m in figures)
    assert gaps.value == pytest.approx(expected_gaps) and gaps.value > 0


def test_the_dashboard_is_valid_and_has_its_variables():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    assert "model_name" in json.dumps(variables["model_name"]["query"])
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        for target in panel["targets"]:
            assert 'model_name="$model_name"' in target["expr"], (panel["title"], target["expr"])
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for word in ("running", "kv cache", "first token", "inter-token", "end-to-end", "queue", "throughput", "success"):
        assert word in titles, word


def test_every_vllm_name_the_dashboard_queries_is_exported(scraped):
    _, families, _ = scraped
    names = dashboard_names(json.loads(DASHBOARD.read_text()))
    assert len(names) >= 10
    missing = sorted(names - exported(families))
    assert missing == [], missing


def test_vllms_example_dashboard_finds_its_names(scraped):
    _, families, _ = scraped
    missing = sorted(set(VLLM_EXAMPLE_DASHBOARD) - exported(families))
    assert missing == [], missing


class _Pool:
    hits, lookups = 0, 0


class _Engine:
    """The figures ServerMetrics reads at scrape time, without a model (two adapters loaded, one
    request running with "a" and one waiting with "b")."""

    pool = _Pool()
    runner = SimpleNamespace(lm=SimpleNamespace(adapters=["a", "b"]))

    def adapters_in_flight(self) -> tuple[list[str], list[str]]:
        return ["a"], ["b"]

    def stats(self) -> dict:
        return {
            "running": 2,
            "waiting": 1,
            "kv_blocks_used": 3,
            "kv_blocks_free": 1,
            "kv_blocks_total": 4,
            "kv_bytes_per_token": 64,
            "tp_ranks": 1,
            "preemptions": 5,
            "decode_compiled": False,
            "decode_compile_s": None,
        }


def test_gaps_count_once_per_token_and_cancelled_calls_are_aborts():
    from pipeline.serve.prometheus import ServerMetrics

    metrics = ServerMetrics(_Engine(), "stub", max_model_len=100)
    figures = {
        "prompt_tokens": 7,
        "generated_tokens": 10,
        "ttft_s": 0.5,
        "tpot_s": 0.02,
        "total_s": 0.7,
        "queue_s": 0.1,
    }
    metrics.finished(figures, "length")
    metrics.finished({**figures, "generated_tokens": 1, "tpot_s": None}, "eos")
    metrics.requests.labels("chat", "499").inc()
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    buckets = {s.labels["le"]: s.value for s in samples(families["vllm:inter_token_latency_seconds"], "_bucket")}
    assert buckets["0.01"] == 0 and buckets["0.025"] == 9 and buckets["+Inf"] == 9
    (gap_sum,) = samples(families["vllm:inter_token_latency_seconds"], "_sum")
    assert gap_sum.value == pytest.approx(0.18)
    (per_request,) = samples(families["vllm:request_time_per_output_token_seconds"], "_count")
    assert per_request.value == 2  # one per request, 0 s for the one-token answer (as vLLM)
    success = {s.labels["finished_reason"]: s.value for s in samples(families["vllm:request_success"], "_total")}
    assert success == {"stop": 1, "length": 1, "abort": 1}
    (prefill,) = samples(families["vllm:request_prefill_time_seconds"], "_sum")
    (decode,) = samples(families["vllm:request_decode_time_seconds"], "_sum")
    assert prefill.value == pytest.approx(2 * 0.4) and decode.value == pytest.approx(2 * 0.2)
    (usage,) = samples(families["vllm:kv_cache_usage_perc"])
    assert usage.value == pytest.approx(0.75)
    (preemptions,) = samples(families["vllm:num_preemptions"], "_total")
    assert preemptions.value == 5
    les = [s.labels["le"] for s in samples(families["vllm:request_prompt_tokens"], "_bucket")]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]
    (lora,) = samples(families["vllm:lora_requests_info"])
    assert lora.labels == {"max_lora": "2", "running_lora_adapters": "a", "waiting_lora_adapters": "b"}
    assert lora.value > 1.7e9  # the scrape time, as vLLM sets it
