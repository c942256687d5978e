"""``kv.offload``: full blocks the pool evicts go to a second tier (host memory, or files on disk
that outlive the process); a later request with that prefix loads them instead of recomputing,
with the tokens of a recompute. A corrupt or foreign file is refused and recomputed. The tier runs
on the weights ``quant=auto`` gives a real checkpoint on CPU (int8wo) as on full precision."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from hydra import compose, initialize_config_dir
from prometheus_client import generate_latest

from conftest import ROOT
from pipeline import Pipeline, Request, UserError, load_model
from pipeline.memory import kv_bytes
from stages import DecodeLoop, Prefill, Tokenize

BLOCKS = 64  # the pool: room for the document or for the filler, not both


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir("llama")


def fresh_lm(model_dir, quant: str = "none"):
    """A model of its own: its pools are shared with no other test (a restart loads it again)."""
    return load_model(str(model_dir), dtype=torch.float32, quant=quant)


def pipe_for(lm, **kv) -> Pipeline:
    memory = BLOCKS * kv_bytes(lm.config, 16, lm.model.dtype, kv_dtype=kv.get("kv_dtype", "auto"))
    return Pipeline(
        lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=memory, max_seqs=1, **kv
    )


def text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice("sea sky cloud river stone light wind tree bird song".split()) for _ in range(n))


DOC = text(0, 200) + " What comes next?"


def ask(pipe: Pipeline, prompt: str = DOC):
    return pipe.run(Request(prompt=prompt, max_new_tokens=8, ignore_eos=True))


def push_out(pipe: Pipeline) -> None:
    """Other work that needs the whole pool: the document's cached blocks are evicted."""
    for seed in (1, 2):
        ask(pipe, text(seed, 400))


@pytest.fixture(scope="module")
def recomputed(model_dir):
    return ask(pipe_for(fresh_lm(model_dir))).token_ids


@pytest.fixture(scope="module")
def recomputed_int8wo(model_dir):
    return ask(pipe_for(fresh_lm(model_dir, "int8wo"))).token_ids


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_an_evicted_prefix_is_loaded_back_with_the_tokens_of_a_recompute(model_dir, tmp_path, recomputed, kind):
    pipe = pipe_for(fresh_lm(model_dir), kv_offload=kind, kv_offload_dir=str(tmp_path) if kind == "disk" else None)
    first = ask(pipe)
    push_out(pipe)
    before = pipe.engine.stats()
    assert before["kv_tier_stores"] > 0 and before["kv_tier_blocks"] > 0
    again = ask(pipe)
    stats = pipe.engine.stats()
    assert first.token_ids == again.token_ids == recomputed
    loaded = stats["kv_tier_hits"] - before["kv_tier_hits"]
    assert loaded >= 20 and again.metrics["kv_reused_tokens"] >= 16 * loaded
    assert (
        stats["kv_tier_bytes_loaded"] == stats["kv_tier_hits"] * pipe.pool.block_bytes and stats["kv_tier_load_s"] > 0
    )


@pytest.mark.parametrize("quant", ["none", "int8wo"])
def test_a_disk_tier_outlives_the_process_that_wrote_it(model_dir, tmp_path, request, quant):
    recomputed = request.getfixturevalue("recomputed" if quant == "none" else "recomputed_int8wo")
    first = pipe_for(fresh_lm(model_dir, quant), kv_offload="disk", kv_offload_dir=str(tmp_path))
    ask(first)
    assert first.pool.spill() > 0  # what a server or chat does as it exits (and a dropped pool)
    restarted = pipe_for(fresh_lm(model_dir, quant), kv_offload="disk", kv_offload_dir=str(tmp_path))
    assert restarted.lm.quant == quant
    again = ask(restarted)
    assert again.token_ids == recomputed
    assert again.metrics["kv_reused_tokens"] >= 400 and restarted.engine.stats()["kv_tier_hits"] > 0


def test_blocks_of_one_weight_scheme_are_never_read_under_another(model_dir, tmp_path, recomputed_int8wo):
    """int8 weights compute other keys and values than full precision: a restart with another
    scheme on the same folder finds nothing there, and recomputes with its own weights."""
    full = pipe_for(fresh_lm(model_dir), kv_offload="disk", kv_offload_dir=str(tmp_path))
    ask(full)
    assert full.pool.spill() > 0
    quantised = pipe_for(fresh_lm(model_dir, "int8wo"), kv_offload="disk", kv_offload_dir=str(tmp_path))
    again = ask(quantised)
    assert again.token_ids == recomputed_int8wo and again.metrics["kv_reused_tokens"] == 0
    assert quantised.engine.stats()["kv_tier_hits"] == 0


def test_quantised_weights_are_fingerprinted_without_reshaping_them(model_dir):
    """torchao's int8 tensors have no view of their data: the fingerprint reads their int8 data and
    scales (bitsandbytes' packed bytes and absmax for nf4), the same for the same weights, and
    another for each scheme of one checkpoint."""
    from pipeline.kv.offload import weights_digest

    digests = {}
    for scheme in ("none", "int8wo", "nf4"):
        lm = fresh_lm(model_dir, scheme)
        assert lm.quant == scheme
        digests[scheme] = weights_digest(lm.model)
        assert digests[scheme] == weights_digest(fresh_lm(model_dir, scheme).model)
    assert len(set(digests.values())) == 3


def test_corrupt_files_are_refused_in_one_line_and_recomputed(model_dir, tmp_path, recomputed, caplog):
    first = pipe_for(fresh_lm(model_dir), kv_offload="disk", kv_offload_dir=str(tmp_path))
    ask(first)
    first.pool.spill()
    for path in tmp_path.glob("*.kvblock"):
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    restarted = pipe_for(fresh_lm(model_dir), kv_offload="disk", kv_offload_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        again = ask(restarted)
    assert again.token_ids == recomputed and again.metrics["kv_reused_tokens"] == 0
    refused = [r for r in caplog.records if "crc" in r.getMessage()]
    assert refused and all("\n" not in r.getMessage() for r in refused)
    assert restarted.engine.stats()["kv_tier_refused"] == len(refused)


def test_another_setting_never_reads_the_files(model_dir, tmp_path):
    """kv.dtype changes every byte of a block: an int8 pool on the same folder finds nothing, and
    leaves the full-precision files alone."""
    full = pipe_for(fresh_lm(model_dir), kv_offload="disk", kv_offload_dir=str(tmp_path))
    ask(full)
    full.pool.spill()
    files = sorted(p.name for p in tmp_path.glob("*.kvblock"))
    other = pipe_for(fresh_lm(model_dir), kv_offload="disk", kv_offload_dir=str(tmp_path), kv_dtype="int8")
    assert ask(other).metrics["kv_reused_tokens"] == 0 and other.engine.stats()["kv_tier_refused"] == 0
    assert set(files) <= {p.name for p in tmp_path.glob("*.kvblock")}


def test_tier_figures_reach_the_metrics_endpoint(model_dir):
    from pipeline.serve.prometheus import ServerMetrics

    pipe = pipe_for(fresh_lm(model_dir), kv_offload="host")
    ask(pipe)
    push_out(pipe)
    ask(pipe)
    exposition = generate_latest(ServerMetrics(pipe.engine).registry).decode()
    for name in (
        "mm_kv_tier_blocks",
        "mm_kv_tier_hits_total",
        "mm_kv_tier_loaded_bytes_total",
        "mm_kv_tier_load_seconds_total",
        "mm_kv_bytes_per_token",
    ):
        assert name in exposition
    assert 'mm_kv_tier_hits_total{tier="host"} 0.0' not in exposition


@pytest.mark.parametrize(
    "override, message",
    [
        ("kv.offload=cloud", "kv.offload must be one of none, host, disk"),
        ("kv.offload=disk", "kv.offload=disk needs kv.offload_dir"),
        ("kv.offload_bytes=-5", "kv.offload_bytes must be a positive number"),
    ],
)
def test_bad_offload_settings_are_refused_before_the_model_loads(override, message):
    from pipeline.cli.settings import check

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[override])
    with pytest.raises(UserError, match=message) as err:
        check(cfg)
    assert "\n" not in str(err.value)


def test_recurrent_models_are_refused_in_one_line(load_tiny):
    pipe = Pipeline(load_tiny("qwen3.5"), {"prefill": Prefill(), "decode": DecodeLoop()}, kv_offload="host")
    with pytest.raises(UserError, match="recurrent states, which are not offloaded"):
        pipe.pool
