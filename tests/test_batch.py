"""mode=batch (resume, per-item errors, shared prefix, accelerate scale-out) and mode=report."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from conftest import ROOT, logprob_oracle, run_cli
from serving import free_port
from pipeline import Pipeline, Request
from pipeline.errors import UserError
from pipeline.modes import batch, processes, report
from stages import DecodeLoop, Prefill, Sampler, Tokenize

CONF_DIR = ROOT / "conf"
N = 6  # max_new_tokens of every batch here
PROMPTS = ["Tell me about the sea.", "Count to five.", "Why?", "Say something.", "Hello there."]


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=list(overrides))


def run_batch(monkeypatch, out: Path, *overrides: str) -> None:
    """mode=batch in this process, writing into ``out`` (what hydra.run.dir=out does on the CLI)."""
    out.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(processes, "run_dir", lambda: out)
    batch.main(compose_cfg("mode=batch", "batch.progress=false", f"max_new_tokens={N}", *overrides))


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def answers(records: list[dict]) -> list[tuple]:
    return [(r["id"], r["prompt"], r.get("text"), r.get("token_ids")) for r in records]


def write_text_prompts(path: Path) -> Path:
    path.write_text("# prompts\n" + "\n".join(PROMPTS[:2]) + "\n\n" + "\n".join(PROMPTS[2:]) + "\n", encoding="utf-8")
    return path  # ids (line numbers): 2, 3, 5, 6, 7


def one_by_one(lm, requests: list[Request]):
    pipe = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop(Sampler())})
    return [pipe.run(r) for r in requests]


# --- input parsing (no model) ----------------------------------------------------------------
def test_text_lines_skip_blank_and_comments_and_ids_are_line_numbers(tmp_path):
    items = batch.read_items(write_text_prompts(tmp_path / "p.txt"))
    assert [(i.id, i.prompt) for i in items] == list(zip([2, 3, 5, 6, 7], PROMPTS))


def test_jsonl_media_paths_are_relative_to_the_file_and_settings_normalised(tmp_path):
    (tmp_path / "sub").mkdir()
    p = tmp_path / "sub" / "p.jsonl"
    p.write_text(
        json.dumps({"id": "x", "prompt": "Hi", "images": "cat.png", "audios": ["/abs/a.wav"], "stop": "END"})
        + "\n\n"
        + json.dumps({"prompt": "Bye", "max_new_tokens": 3})
        + "\n",
        encoding="utf-8",
    )
    first, second = batch.read_items(p)
    assert first.images == [str(tmp_path / "sub" / "cat.png")] and first.audios == ["/abs/a.wav"]
    assert first.settings == {"stop": ["END"]}
    assert second.id == 3 and second.settings == {"max_new_tokens": 3}  # no id: the line number


@pytest.mark.parametrize(
    "bad, words",
    [
        ('{"id": 3, "prompt": "oops"', ["not valid JSON"]),
        ('["a list"]', ["JSON object"]),
        ('{"id": 3, "prompt": "x", "max_tokens": 5}', ["unknown key", "max_tokens"]),
        ('{"id": 3, "prompt": "x", "max_new_tokens": 0}', ["max_new_tokens"]),
        ('{"id": 3, "prompt": "x", "ignore_eos": "yes"}', ["ignore_eos"]),
        ('{"id": 3}', ["no prompt"]),
        ('{"id": [3], "prompt": "x"}', ["id must be"]),
        ('{"id": "a", "prompt": "again"}', ["duplicate id 'a'", "first on line 1"]),
        ('{"id": 3, "prompt": "x", "logprobs": 21}', ["logprobs must be a whole number from 0 to 20", "21"]),
        ('{"id": 3, "prompt": "x", "logprobs": -1}', ["logprobs must be", "-1"]),
        ('{"id": 3, "prompt": "x", "logprobs": "x"}', ["logprobs must be", "'x'"]),
        ('{"id": 3, "prompt": "x", "logprobs": true}', ["logprobs must be", "True"]),
        ('{"id": 3, "prompt": "x", "prompt_logprobs": 2.5}', ["prompt_logprobs must be", "2.5"]),
        ('{"id": 3, "prompt": "x", "logprobs_mode": "greedy"}', ["logprobs_mode must be one of raw, processed"]),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path, bad, words):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "fine"}\n\n' + bad + "\n", encoding="utf-8")
    with pytest.raises(UserError) as err:
        batch.read_items(p)
    msg = str(err.value)
    assert "\n" not in msg and f"{p} line 3" in msg, msg
    for word in words:
        assert word in msg, msg


def test_bad_input_fails_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(batch, "load_from_cfg", lambda cfg: pytest.fail("the model was loaded"))
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": \n', encoding="utf-8")
    with pytest.raises(UserError, match=r"p\.jsonl line 2: not valid JSON"):
        run_batch(monkeypatch, tmp_path / "out", f"input={p}")
    for args, pattern in [
        ([f"input={tmp_path / 'nope.txt'}"], "does not exist"),
        ([], "needs input=FILE"),
        ([f"input={p}", "prompt=hi"], "leave prompt= out"),
    ]:
        with pytest.raises(UserError, match=pattern):
            run_batch(monkeypatch, tmp_path / "out", *args)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n", encoding="utf-8")
    with pytest.raises(UserError, match="no prompts"):
        run_batch(monkeypatch, tmp_path / "out", f"input={empty}")


@pytest.mark.parametrize(
    "line, overrides, pattern",
    [
        ('{"id": 1, "prompt": "a", "logprobs": 21}', [], r"p\.jsonl line 2: logprobs must be a whole number"),
        ('{"id": 1, "prompt": "a"}', ["batch.logprobs=21"], r"^batch\.logprobs must be a whole number from 0 to 20"),
        ('{"id": 1, "prompt": "a"}', ["batch.logprobs_mode=top"], r"^batch\.logprobs_mode must be one of raw"),
        (
            '{"id": 1, "prompt": "a", "logprobs": 0}',
            ["decode.speculative=ngram"],
            r"p\.jsonl line 2: logprobs with speculative decoding",
        ),
        (
            '{"id": 1, "prompt": "a"}',
            ["batch.logprobs=1", "decode.speculative=ngram"],
            r"^batch\.logprobs: logprobs with speculative decoding",
        ),
    ],
)
def test_bad_logprob_settings_fail_before_the_model_loads(tmp_path, monkeypatch, line, overrides, pattern):
    monkeypatch.setattr(batch, "load_from_cfg", lambda cfg: pytest.fail("the model was loaded"))
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": 0, "prompt": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=pattern) as err:
        run_batch(monkeypatch, tmp_path / "out", f"input={p}", *overrides)
    assert "\n" not in str(err.value)


def test_half_written_journal_line_is_cut_before_appending(tmp_path):
    part = tmp_path / "results.part0.jsonl"
    part.write_text('{"id": 1, "prompt": "a", "text": "x"}\n{"id": 2, "pro', encoding="utf-8")
    assert batch.read_records(part) == ([{"id": 1, "prompt": "a", "text": "x"}], 1)
    batch.repair_journal(part)
    assert part.read_text(encoding="utf-8") == '{"id": 1, "prompt": "a", "text": "x"}\n'


def test_a_rank_drops_its_own_hydra_folder_only_when_hydra_wrote_nothing_else(tmp_path):
    empty, used = tmp_path / "a", tmp_path / "b"
    for folder in (empty, used):
        (folder / ".hydra").mkdir(parents=True)
        (folder / "__main__.log").write_text("")
    (used / "results.jsonl").write_text("{}\n")
    processes._remove_if_only_hydra(empty)
    processes._remove_if_only_hydra(used)
    assert not empty.exists() and (used / "results.jsonl").exists()


def test_summary_percentiles():
    assert batch.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert batch.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert batch.percentile([], 50) is None


# --- batch on the tiny model -----------------------------------------------------------------
def test_batch_equals_one_by_one_runs(tmp_path, tiny_dir, load_tiny, monkeypatch):
    p = tmp_path / "p.jsonl"
    rows = [
        {"id": "a", "prompt": PROMPTS[0]},
        {"id": "b", "prompt": PROMPTS[1], "max_new_tokens": 3},
        {"id": 7, "prompt": PROMPTS[2], "system_prompt": "Be brief.", "ignore_eos": True},
        {"prompt": PROMPTS[3], "stop": ["e"], "thinking": False},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "out"
    run_batch(monkeypatch, out, f"input={p}", f"model.path={tiny_dir('qwen3')}")

    records = lines(out / "results.jsonl")
    expected = one_by_one(
        load_tiny("qwen3"),
        [
            Request(prompt=PROMPTS[0], max_new_tokens=N),
            Request(prompt=PROMPTS[1], max_new_tokens=3),
            Request(prompt=PROMPTS[2], max_new_tokens=N, system_prompt="Be brief.", ignore_eos=True),
            Request(prompt=PROMPTS[3], max_new_tokens=N, stop=["e"], thinking=False),
        ],
    )
    assert [r["id"] for r in records] == ["a", "b", 7, 4]
    assert {tuple(r) for r in records} == {("id", "prompt", "text", "token_ids", "finish_reason", "metrics")}
    assert [(r["text"], r["token_ids"]) for r in records] == [(e.text, e.token_ids) for e in expected]
    assert records[2]["metrics"]["generated_tokens"] == N  # ignore_eos reached the item
    assert not list(out.glob("results.part*"))  # merged and cleaned up

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["items"], summary["ok"], summary["errors"]) == (4, 4, 0)
    assert summary["totals"]["generated_tokens"] == sum(len(e.token_ids) for e in expected)
    for key in ("ttft_s", "tpot_s", "tokens_per_s"):
        d = summary[key]
        assert d["mean"] > 0 and d["p50"] <= d["p90"] <= d["p99"]
    assert summary["weights_bytes"] > 0 and summary["quant"] == "none" and summary["num_processes"] == 1
    assert summary["max_seqs"] == 8 and summary["throughput_tok_s"] > 0  # the items ran concurrently


def prompt_ids(lm, prompt: str) -> list[int]:
    """The ids the batch's Tokenize renders ``prompt`` to (chat template included)."""
    return Pipeline(lm, {"tokenize": Tokenize()}).tokenize(Request(prompt=prompt)).input_ids[0].tolist()


def assert_oracle(entries: list[dict], ids: list[int], reference, k: int, text) -> None:
    """Entry j scores ids[j] with reference row j: its log-probability, its k best alternatives."""
    assert [e["token_id"] for e in entries] == ids and [e["token"] for e in entries] == [text(t) for t in ids]
    for j, e in enumerate(entries):
        assert e["logprob"] == pytest.approx(float(reference[j, ids[j]]), abs=1e-4)
        values, top = reference[j].topk(k)
        assert [t for t, _ in e["top_logprobs"]] == top.tolist()
        assert [v for _, v in e["top_logprobs"]] == pytest.approx(values.tolist(), abs=1e-4)


def logprob_values(records: list[dict], key: str) -> list[float | None]:
    """Every record's ``key`` entries' log-probabilities, one flat list (None: an unscored position)."""
    return [e and e["logprob"] for r in records for e in r.get(key) or []]


def test_logprobs_are_written_for_the_items_that_ask_and_match_a_plain_forward(
    tmp_path, tiny_dir, load_tiny, monkeypatch
):
    """batch.logprobs=0 is every item's default; a, b and c override it for themselves."""
    p = tmp_path / "p.jsonl"
    rows = [
        {"id": "a", "prompt": PROMPTS[0], "logprobs": 2, "ignore_eos": True},
        {"id": "b", "prompt": PROMPTS[1], "prompt_logprobs": 1, "max_new_tokens": 2, "ignore_eos": True},
        {"id": "c", "prompt": PROMPTS[2], "logprobs": None},
        {"id": "d", "prompt": PROMPTS[3], "ignore_eos": True},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    model = f"model.path={tiny_dir('qwen3')}"
    out = tmp_path / "out"
    run_batch(monkeypatch, out, f"input={p}", model, "batch.logprobs=0")
    a, b, c, d = records = lines(out / "results.jsonl")
    lm = load_tiny("qwen3")
    text = lambda t: lm.tokenizer.decode([t])  # noqa: E731

    ids = prompt_ids(lm, PROMPTS[0])
    assert len(a["logprobs"]) == len(a["token_ids"]) == N and "prompt_logprobs" not in a
    assert_oracle(a["logprobs"], a["token_ids"], logprob_oracle(lm, ids + a["token_ids"])[len(ids) - 1 :], 2, text)

    ids = prompt_ids(lm, PROMPTS[1])
    assert b["prompt_ids"] == ids and len(b["prompt_logprobs"]) == len(ids) and b["prompt_logprobs"][0] is None
    assert_oracle(b["prompt_logprobs"][1:], ids[1:], logprob_oracle(lm, ids), 1, text)
    assert [e["top_logprobs"] for e in b["logprobs"]] == [[], []]  # batch.logprobs=0: no alternatives

    assert list(c) == ["id", "prompt", "text", "token_ids", "finish_reason", "metrics"]
    assert len(d["logprobs"]) == N and all(e["top_logprobs"] == [] for e in d["logprobs"])

    run_batch(monkeypatch, tmp_path / "shared", f"input={p}", model, "batch.logprobs=0", "batch.shared_prefix=true")
    shared = lines(tmp_path / "shared" / "results.jsonl")
    assert answers(shared) == answers(records)
    for key in ("logprobs", "prompt_logprobs"):  # the shared-prefix path writes them alike
        assert logprob_values(shared, key) == pytest.approx(logprob_values(records, key), abs=1e-4)

    run_batch(monkeypatch, out, f"input={p}", model)  # a changed setting re-runs nothing, like max_new_tokens
    assert lines(out / "results.jsonl") == records


def test_item_error_keeps_the_others_and_is_retried_on_resume(tmp_path, tiny_dir, monkeypatch):
    p = tmp_path / "p.jsonl"
    p.write_text(
        json.dumps({"id": 1, "prompt": PROMPTS[0]})
        + "\n"
        + json.dumps({"id": 2, "prompt": "Look.", "images": "missing.png"})
        + "\n"
        + json.dumps({"id": 3, "prompt": PROMPTS[1]})
        + "\n",
        encoding="utf-8",
    )
    out = tmp_path / "out"
    with pytest.raises(UserError) as err:
        run_batch(monkeypatch, out, f"input={p}", f"model.path={tiny_dir('qwen3')}")
    assert "1 of 3 items failed" in str(err.value) and "id 2" in str(err.value) and "\n" not in str(err.value)
    first = lines(out / "results.jsonl")
    assert [r["id"] for r in first] == [1, 2, 3]
    assert "missing.png" in first[1]["error"] and "text" not in first[1]
    assert first[0]["text"] is not None and first[2]["token_ids"]

    # Fix the file: the item is retried (now it fails for another reason: a text-only model).
    from PIL import Image

    Image.new("RGB", (32, 32), "red").save(tmp_path / "missing.png")
    with pytest.raises(UserError, match="1 of 3 items failed"):
        run_batch(monkeypatch, out, f"input={p}", f"model.path={tiny_dir('qwen3')}")
    second = lines(out / "results.jsonl")
    assert "image encoder" in second[1]["error"]
    assert second[0] == first[0] and second[2] == first[2]  # finished items were not run again


def test_shared_prefix_gives_the_same_answers(tmp_path, tiny_dir, monkeypatch):
    p = write_text_prompts(tmp_path / "p.txt")
    common = [f"input={p}", f"model.path={tiny_dir('qwen3')}", "system_prompt=You answer questions about the sea."]
    run_batch(monkeypatch, tmp_path / "plain", *common)
    run_batch(monkeypatch, tmp_path / "shared", *common, "batch.shared_prefix=true")
    plain, shared = lines(tmp_path / "plain" / "results.jsonl"), lines(tmp_path / "shared" / "results.jsonl")
    assert answers(shared) == answers(plain)
    assert [r["metrics"]["kv_reused_tokens"] > 0 for r in shared] == [False] + [True] * (len(shared) - 1)
    assert json.loads((tmp_path / "shared" / "summary.json").read_text())["shared_prefix"] is True


def test_interrupted_batch_resumes_without_loss_or_duplicates(tmp_path, tiny_dir, monkeypatch):
    p = write_text_prompts(tmp_path / "p.txt")
    model = f"model.path={tiny_dir('qwen3')}"
    out = tmp_path / "killed"
    proc = run_cli(
        "mode=batch",
        f"input={p}",
        model,
        f"max_new_tokens={N}",
        f"hydra.run.dir={out}",
        env={batch.EXIT_AFTER_ENV: "2"},
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    journal = out / "results.part0.jsonl"
    done = lines(journal)
    assert [r["id"] for r in done] == [2, 3] and not (out / "results.jsonl").exists()
    with open(journal, "a", encoding="utf-8") as f:  # what a kill in the middle of a write leaves
        f.write('{"id": 5, "prompt": "Why?", "te')

    run_batch(monkeypatch, out, f"input={p}", model)
    resumed = lines(out / "results.jsonl")
    run_batch(monkeypatch, tmp_path / "whole", f"input={p}", model)
    assert [r["id"] for r in resumed] == [2, 3, 5, 6, 7]
    assert answers(resumed) == answers(lines(tmp_path / "whole" / "results.jsonl"))
    assert resumed[:2] == done  # the journaled items were kept, not recomputed

    run_batch(monkeypatch, out, f"input={p}", model)  # a finished batch re-run changes nothing
    assert lines(out / "results.jsonl") == resumed


@pytest.mark.slow
def test_two_process_accelerate_launch_equals_one_process(tmp_path, held_out_dir, monkeypatch):
    """On CPU, accelerate needs --multi_gpu to start N processes (--cpu alone starts one). A held-out
    checkpoint with no quant= given: each process loads the int8wo weights one process loads."""
    p = write_text_prompts(tmp_path / "p.txt")
    model = f"model.path={held_out_dir('qwen3')}"
    out = tmp_path / "two"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        "-m",
        "pipeline",
        "mode=batch",
        f"input={p}",
        model,
        f"max_new_tokens={N}",
        f"hydra.run.dir={out}",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["quant"] == "int8wo"

    run_batch(monkeypatch, tmp_path / "one", f"input={p}", model, "model.device_map=cpu")
    two = lines(out / "results.jsonl")
    assert answers(two) == answers(lines(tmp_path / "one" / "results.jsonl"))
    assert [r["id"] for r in two] == [2, 3, 5, 6, 7]
    assert not list(out.glob("results.part*"))


# --- report ----------------------------------------------------------------------------------
def run_report(*overrides: str) -> None:
    report.main(compose_cfg("mode=report", *overrides))


def read_csv(path: Path) -> list[dict]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_report_over_a_two_job_multirun(tmp_path, tiny_dir, monkeypatch):
    sweep = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "max_new_tokens=2,3",
        f"hydra.sweep.dir={sweep}",
        f"model.path={tiny_dir('qwen3')}",
        "prompt=Hi",
        "ignore_eos=true",
        "metrics_table=false",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for job, n in (("0", 2), ("1", 3)):  # every job wrote its own result in its own folder
        assert len(json.loads((sweep / job / "result.json").read_text())["token_ids"]) == n

    import pipeline.cli.assemble

    monkeypatch.setattr(pipeline.cli.assemble, "load_from_cfg", lambda cfg: pytest.fail("report loaded a model"))
    run_report(f"dir={sweep}")
    rows = read_csv(sweep / "report.csv")
    assert [(r["job"], r["max_new_tokens"], r["status"]) for r in rows] == [("0", "2", "ok"), ("1", "3", "ok")]
    for r in rows:
        assert float(r["ttft_s"]) > 0 and float(r["decode_tok_s"]) > 0 and int(r["weights_bytes"]) > 0
        assert r["quant"] == "none" and int(r["peak_memory_bytes"]) > 0
    md = (sweep / "report.md").read_text()
    assert "| job | max_new_tokens |" in md and md.count("\n| 0 |") + md.count("\n| 1 |") == 2
    assert (sweep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def fake_job(folder: Path, overrides: list[str], name: str | None = None, data: dict | None = None) -> None:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if name:
        (folder / name).write_text(json.dumps(data))


def test_report_reads_batch_summaries_bench_grids_and_failed_jobs(tmp_path):
    fake_job(
        tmp_path / "0",
        ["mode=batch", "+model=qwen3"],
        "summary.json",
        {
            "items": 3,
            "errors": 1,
            "ttft_s": {"mean": 0.5, "p50": 0.4},
            "tpot_s": {"mean": 0.02},
            "prefill_tok_s": 100.0,
            "decode_tok_s": 50.0,
            "peak_memory_bytes": 10,
            "weights_bytes": 20,
            "quant": "nf4",
        },
    )
    sample = {"ttft_s": 0.1, "tg_tok_s": 40.0, "prefill_tok_s": 300.0, "decode_tok_s": 40.0, "peak_memory_bytes": 7}
    fake_job(
        tmp_path / "1",
        ["mode=bench", "quant=none"],
        "bench.json",
        {
            "quant": "none",
            "weights_bytes": 30,
            "rows": [
                {"test": "pp32+tg16", "pipeline": {"samples": [sample, dict(sample, ttft_s=0.3)]}},
                {"test": "pp128+tg16", "pipeline": {"samples": [sample]}},
            ],
        },
    )
    fake_job(tmp_path / "10", ["mode=run"])  # a job that crashed: no result file
    run_report(f"dir={tmp_path}")
    rows = read_csv(tmp_path / "report.csv")
    assert [(r["job"], r["test"]) for r in rows] == [("0", ""), ("1", "pp32+tg16"), ("1", "pp128+tg16"), ("10", "")]
    assert rows[0]["ttft_s"] == "0.5" and rows[0]["quant"] == "nf4" and rows[0]["status"] == "1 of 3 items failed"
    assert rows[0]["model"] == "qwen3" and rows[1]["quant"] == "none"
    assert float(rows[1]["ttft_s"]) == pytest.approx(0.2) and float(rows[1]["tpot_s"]) == pytest.approx(0.025)
    assert rows[3]["status"].startswith("no result") and rows[3]["ttft_s"] == ""


def test_report_has_one_column_per_quantity_when_a_reported_setting_is_swept(tmp_path):
    """quant swept (an override) and reported by every result: one quant column, holding what ran
    (auto resolved), the override where the job wrote no result; the plot labels still name it."""
    metrics = {"ttft_s": 0.1, "decode_tok_s": 50.0, "weights_bytes": 20}
    fake_job(tmp_path / "0", ["quant=auto"], "result.json", {"metrics": dict(metrics, quant="nf4")})
    fake_job(tmp_path / "1", ["quant=none"], "result.json", {"metrics": dict(metrics, quant="none")})
    fake_job(tmp_path / "2", ["quant=int8"])  # failed: no result
    run_report(f"dir={tmp_path}")
    header = (tmp_path / "report.csv").read_text(encoding="utf-8").splitlines()[0].split(",")
    assert header.count("quant") == 1 and len(header) == len(set(header)), header
    assert header[:2] == ["job", "quant"]
    md_header = next(
        line for line in (tmp_path / "report.md").read_text(encoding="utf-8").splitlines() if line.startswith("| job |")
    )
    assert md_header.count("quant") == 1 and md_header.startswith("| job | quant | ttft_s |")
    assert [r["quant"] for r in read_csv(tmp_path / "report.csv")] == ["nf4", "none", "int8"]
    columns, rows = report.gather(tmp_path)
    assert report.labels(columns, rows) == ["quant=nf4", "quant=none", "quant=int8"]


def test_report_errors_are_one_line(tmp_path):
    cases = [
        ([], "needs dir="),
        ([f"dir={tmp_path / 'nope'}"], "does not exist"),
        ([f"dir={tmp_path}"], "no Hydra job folders"),
    ]
    for args, words in cases:
        with pytest.raises(UserError) as err:
            run_report(*args)
        assert words in str(err.value) and "\n" not in str(err.value)


def test_each_line_answers_with_its_adapter(tmp_path, held_out_dir, monkeypatch):
    from pipeline.model.loading import load_model
    from pipeline.testing.lora import make_adapter

    base = held_out_dir("qwen3")
    adapters = {name: make_adapter(base, tmp_path / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}
    lora = "model.lora={" + ", ".join(f"{n}: {p}" for n, p in adapters.items()) + "}"
    p = tmp_path / "p.jsonl"
    rows = [{"prompt": PROMPTS[0], "adapter": "a"}, {"prompt": PROMPTS[0]}, {"prompt": PROMPTS[0], "adapter": "b"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    lm = load_model(str(base), quant="none")
    for name, path in adapters.items():
        lm.load_adapter(name, str(path))
    expected = one_by_one(lm, [Request(prompt=PROMPTS[0], max_new_tokens=N, adapter=r.get("adapter")) for r in rows])
    assert len({tuple(e.token_ids) for e in expected}) == 3
    for shared in ("false", "true"):  # shared prefixes only within one adapter
        out = tmp_path / f"out-{shared}"
        run_batch(
            monkeypatch, out, f"input={p}", f"model.path={base}", "quant=none", lora, f"batch.shared_prefix={shared}"
        )
        records = lines(out / "results.jsonl")
        assert [r["token_ids"] for r in records] == [e.token_ids for e in expected]
        assert [r["metrics"].get("adapter") for r in records] == ["a", None, "b"]
    p.write_text(json.dumps({"prompt": "x", "adapter": "zzz"}) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match="line 1: adapter 'zzz' is not in model.lora"):
        run_batch(monkeypatch, tmp_path / "bad", f"input={p}", f"model.path={base}", lora)
