"""mode=bench: every grid cell reported, files written, the HF baseline beside it, bad grids refused."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from conftest import run_cli
from pipeline import Pipeline, UserError
from pipeline.memory import kv_bytes
from pipeline.modes import bench
from pipeline.modes.bench import BenchSettings, settings_from_cfg

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
TINY_GRID = ["bench.prompt_lengths=[4,8]", "bench.gen_lengths=[2,3]", "bench.repetitions=2", "bench.warmup=1"]


def make_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=["mode=bench", *overrides])


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("qwen3")


def test_default_grid_is_valid():
    s = settings_from_cfg(make_cfg())
    assert s.cells == [(32, 16, 1), (32, 64, 1), (128, 16, 1), (128, 64, 1)]
    assert s.repetitions >= 1 and s.warmup >= 0 and s.baseline is None


def test_single_length_is_a_one_cell_axis():
    s = settings_from_cfg(make_cfg("bench.prompt_lengths=16", "bench.gen_lengths=[8,8]"))
    assert s.cells == [(16, 8, 1)]


@pytest.mark.parametrize(
    "override, message",
    [
        ("bench.prompt_lengths=[]", "bench.prompt_lengths is empty"),
        ("bench.gen_lengths=[]", "bench.gen_lengths is empty"),
        ("bench.prompt_lengths=[32,0]", "bench.prompt_lengths has 0"),
        ("bench.gen_lengths=[-4]", "bench.gen_lengths has -4"),
        ("bench.prompt_lengths=[abc]", "bench.prompt_lengths has 'abc'"),
        ("bench.gen_lengths=[1.5]", "bench.gen_lengths has 1.5"),
        ("bench.repetitions=0", "bench.repetitions must be an integer >= 1"),
        ("bench.warmup=-1", "bench.warmup must be an integer >= 0"),
        ("bench.baseline=vllm", "bench.baseline must be null or one of hf"),
        ("bench.batch_sizes=[0]", "bench.batch_sizes has 0"),
        ("bench.speculative=[none,medusa]", "bench.speculative has 'medusa'"),
        ("bench.speculative=[none,draft]", "bench.speculative has draft: set decode.draft_model"),
    ],
)
def test_bad_grid_values_are_one_line_errors(override, message):
    with pytest.raises(UserError, match=message) as err:
        bench.main(make_cfg(override))  # fails before any model is loaded
    assert "\n" not in str(err.value)


def test_grid_longer_than_the_model_or_the_kv_pool_is_refused(lm):
    limit = lm.config.max_position_embeddings
    with pytest.raises(UserError, match=f"exceed the model's {limit} positions"):
        bench.check_fits(bench.bench_pipeline(lm), BenchSettings(prompt_lengths=(limit,), gen_lengths=(1,)))
    small = Pipeline(lm, bench.bench_pipeline(lm).stages, kv_memory=2 * kv_bytes(lm.config, 16, torch.float32))
    with pytest.raises(UserError, match="exceed the KV pool's 32"):
        bench.run_grid(small, BenchSettings(prompt_lengths=(8, 30), gen_lengths=(8,)))


def test_batch_axis_reports_aggregate_figures(lm):
    rows = bench.run_grid(
        bench.bench_pipeline(lm), BenchSettings((6,), (4,), batch_sizes=(1, 4), repetitions=1, warmup=0, baseline="hf")
    )
    assert [(r.test, r.batch) for r in rows] == [("pp6+tg4", 1), ("pp6+tg4 B4", 4)]
    for r in rows:
        assert r.stats()["tg_tok_s"]["mean"] > 0 and r.ratios()["pptg_tok_s"] > 0


def test_python_api_runs_a_grid_without_baseline(lm):
    rows = bench.run_grid(bench.bench_pipeline(lm), BenchSettings((4,), (3,), repetitions=2, warmup=0))
    assert [r.test for r in rows] == ["pp4+tg3"]
    assert len(rows[0].pipeline) == 2 and rows[0].baseline == [] and rows[0].ratios() == {}
    assert rows[0].stats()["tg_tok_s"]["mean"] > 0


def test_speculative_rows_compare_methods_on_the_same_prompts(lm):
    rows = bench.run_grid(
        bench.bench_pipeline(lm), BenchSettings((8,), (12,), repetitions=1, warmup=0, speculative=("none", "ngram"))
    )
    assert [(r.test, r.speculative) for r in rows] == [("pp8+tg12 none", "none"), ("pp8+tg12 ngram", "ngram")]
    assert rows[0].pipeline[0]["spec_accept_rate"] is None
    assert rows[1].pipeline[0]["spec_tokens_per_step"] >= 1.0
    assert rows[1].to_dict()["speculative"] == "ngram"


def test_synthetic_prompt_is_seeded_and_avoids_special_tokens(lm):
    a = bench.synthetic_prompt(lm, 64, seed=0)
    assert a == bench.synthetic_prompt(lm, 64, seed=0) != bench.synthetic_prompt(lm, 64, seed=1)
    special = set(lm.tokenizer.all_special_ids) | set(lm.tokenizer.added_tokens_decoder)
    assert len(a) == 64 and not special & set(a) and max(a) < len(lm.tokenizer)


def test_bench_with_hf_baseline_reports_every_cell(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bench.main(make_cfg(f"model.path={tiny_dir('qwen3')}", "bench.baseline=hf", *TINY_GRID))
    expected = ["pp4+tg2", "pp4+tg3", "pp8+tg2", "pp8+tg3"]

    table = capsys.readouterr().out
    body = [line for line in table.splitlines() if line.startswith("| pp")]
    assert [line.split("|")[1].strip() for line in body] == expected
    assert "hf tg t/s" in table and "ratio pp+tg" in table

    with open(tmp_path / "bench.csv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["test"] for r in rows] == expected
    assert [(int(r["prompt_tokens"]), int(r["gen_tokens"])) for r in rows] == [(4, 2), (4, 3), (8, 2), (8, 3)]
    for r in rows:
        assert r["repetitions"] == "2"
        for key in ("pp_tok_s", "tg_tok_s", "pptg_tok_s", "ttft_s", "hf_tg_tok_s", "hf_pptg_tok_s"):
            assert float(r[f"{key}_mean"]) > 0 and float(r[f"{key}_std"]) >= 0
        for key in ("ratio_pp", "ratio_tg", "ratio_pptg"):
            assert float(r[key]) > 0

    data = json.loads((tmp_path / "bench.json").read_text(encoding="utf-8"))
    assert data["settings"]["baseline"] == "hf" and data["settings"]["prompt_lengths"] == [4, 8]
    assert [r["test"] for r in data["rows"]] == expected
    for r in data["rows"]:
        assert len(r["pipeline"]["samples"]) == 2 and len(r["hf"]["samples"]) == 2  # warmup not counted
        assert set(r["ratio"]) == {"pp_tok_s", "tg_tok_s", "pptg_tok_s"}
        assert all(s["kv_cache_bytes"] > 0 for s in r["pipeline"]["samples"])

    md = (tmp_path / "bench.md").read_text(encoding="utf-8")
    assert all(f"| {t} |" in md for t in expected)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # mode=bench through a subprocess; its grid is checked in-process
def test_cli_bench_without_baseline(tiny_dir, tmp_path):
    run = tmp_path / "run"
    proc = run_cli(
        "mode=bench",
        f"model.path={tiny_dir('qwen3')}",
        "bench.prompt_lengths=[4]",
        "bench.gen_lengths=[1,2]",
        "bench.repetitions=1",
        "bench.warmup=0",
        f"hydra.run.dir={run}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("| test |") and "hf" not in lines[0]
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["pp4+tg1", "pp4+tg2"]
    assert "n/a" in lines[2]  # one generated token: no decode step to time
    for name in ("bench.md", "bench.csv", "bench.json", "bench.png"):
        assert (run / name).is_file()
    with open(run / "bench.csv", encoding="utf-8", newline="") as f:
        header = next(csv.reader(f))
    assert "ratio_tg" not in header and "hf_tg_tok_s_mean" not in header
