"""The command-line contract, end to end through `python -m pipeline` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, generate_oracle, run_cli


def read_result(folder) -> dict:
    return json.loads((folder / "result.json").read_text())


def test_model_path_alone_matches_generate_and_stdout_is_only_the_answer(tiny_dir, load_tiny, tmp_path):
    proc = run_cli(
        f"model.path={tiny_dir('qwen3')}",
        "prompt=Name three colours.",
        "max_new_tokens=10",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    result = read_result(tmp_path)
    assert set(result) >= {"text", "token_ids", "prompt_ids", "prompt_tokens", "metrics"}
    assert proc.stdout == result["text"] + "\n"  # logs and the table went to stderr
    assert "ttft_s" in proc.stderr and "decode_tok_s" in proc.stderr
    lm = load_tiny("qwen3")
    ids = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    assert result["prompt_ids"] == ids[0].tolist()
    assert result["prompt_tokens"] == len(result["prompt_ids"])
    assert result["token_ids"] == generate_oracle(lm, ids, 10)
    m = result["metrics"]
    for key in (
        "ttft_s",
        "tpot_s",
        "prefill_tok_s",
        "decode_tok_s",
        "sample_s",
        "kv_cache_bytes",
        "kv_reused_tokens",
        "peak_memory_bytes",
        "bandwidth_gb_s",
    ):
        assert key in m, key
    for stage in ("tokenize", "prefill", "decode"):
        assert m["stages"][stage]["seconds"] > 0


def test_named_model_with_local_path_system_prompt_and_sampler_settings(tiny_dir, tmp_path):
    proc = run_cli(
        "+model=qwen3",
        f"model.path={tiny_dir('qwen3')}",
        "system_prompt=Be terse.",
        "prompt=Hi",
        "thinking=false",
        "max_new_tokens=6",
        "ignore_eos=true",
        "sampler=sample",
        "sampler.temperature=0.9",
        "sampler.seed=3",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    result = read_result(tmp_path)
    assert len(result["token_ids"]) == 6
    assert result["metrics"]["generated_tokens"] == 6


@pytest.mark.parametrize(
    "args, message",
    [
        (["+model=no-such-model"], "unknown model 'no-such-model'"),
        (["prompt="], "prompt is empty"),  # these four answer before torch loads: a second each
        (["max_new_tokens=0"], "max_new_tokens must be an integer >= 1"),
        (["engine.burst=x"], "engine.burst=x: Value 'x' of type 'str' could not be converted to Integer"),
        (["foo=1"], "Could not override 'foo'"),
        # checked in-process too (test_before_load, test_sampler); they load the library: slow cases
        pytest.param(["model.path=/no/such/dir"], "does not exist", marks=pytest.mark.slow),
        pytest.param(["sampler.temperature=-1"], "temperature", marks=pytest.mark.slow),
    ],
)
def test_bad_input_is_one_line_and_nonzero(tiny_dir, tmp_path, args, message):
    base = [] if any(a.startswith(("+model", "model.path")) for a in args) else [f"model.path={tiny_dir('qwen3')}"]
    proc = run_cli(*base, *args, f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert not (tmp_path / "result.json").exists()


def test_cfg_job_prints_the_composed_config():
    proc = run_cli("+model=qwen3", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert "path: Qwen/Qwen3-0.6B" in proc.stdout and "_target_: stages.Prefill" in proc.stdout


@pytest.mark.slow  # test_cli_hygiene's sweep checks one result per job too (suite time)
def test_multirun_writes_one_result_per_job(tiny_dir, tmp_path):
    proc = run_cli(
        "-m",
        f"model.path={tiny_dir('qwen3')}",
        "prompt=Hi",
        "max_new_tokens=2,3",
        "ignore_eos=true",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    lengths = sorted(len(read_result(tmp_path / str(i))["token_ids"]) for i in range(2))
    assert lengths == [2, 3]


@pytest.mark.slow  # a sampler swapped by an override also runs in test_stage_hooks' CLI case (with both phases)
def test_custom_stage_swapped_with_one_override(tiny_dir, tmp_path):
    # The chain is config: one override swaps the sampler the decode stage uses for a user class.
    proc = run_cli(
        f"model.path={tiny_dir('qwen3')}",
        "prompt=Hi",
        "max_new_tokens=4",
        "ignore_eos=true",
        "sampler._target_=tests.helpers.FirstTokenSampler",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    assert read_result(tmp_path)["token_ids"] == [0, 0, 0, 0]


def test_help_introduces_the_program():
    proc = run_cli("--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith("mm-pipeline: multimodal LLM inference")
    assert "python -m pipeline +model=qwen2-vl" in proc.stdout and "== Configuration groups ==" in proc.stdout
    assert "powered by Hydra" not in proc.stdout


@pytest.mark.parametrize(
    "args, code",
    [(["--help"], 0), (["--cfg", "job"], 0), (["max_new_tokens=0"], 2), (["foo=1"], 2), (["+model=no-such-model"], 2)],
)
def test_help_and_refused_settings_answer_before_torch_loads(args, code):
    """What needs no model answers without importing torch or transformers (a second, not ten)."""
    probe = (
        "import runpy, sys\n"
        "sys.argv[0], code = 'pipeline', 0\n"
        "try:\n    runpy.run_module('pipeline', run_name='__main__')\n"
        "except SystemExit as stop:\n    code = stop.code or 0\n"
        "print('loaded:', 'torch' in sys.modules, 'transformers' in sys.modules, code, file=sys.stderr)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stderr.splitlines()[-1] == f"loaded: False False {code}", proc.stderr


def test_a_stage_valueerror_is_one_line(tmp_path):
    proc = run_cli(
        "+stages.check._target_=tests.helpers.RefusingStage", "max_new_tokens=2", f"hydra.run.dir={tmp_path}"
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: RefusingStage: this context is not what I expected"
    assert "Traceback" not in proc.stderr
