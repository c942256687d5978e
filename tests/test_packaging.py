"""A non-editable install (a wheel) carries the configs, so `python -m pipeline` works from anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_packages_and_configs_and_runs_from_another_folder(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("mm_pipeline-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "pipeline/__main__.py",
        "stages/prefill.py",
        "pipeline/conf/config.yaml",
        "pipeline/conf/model/qwen3.yaml",
        "pipeline/conf/sampler/greedy.yaml",
        "pipeline/conf/mode/serve.yaml",
        "pipeline/serve/static/chat.html",
        "pipeline/tiny/shapes_model/model.safetensors",
        "pipeline/tiny/shapes_model/config.json",
        "pipeline/tiny/shapes_model/tokenizer.json",
        "pipeline/tiny/shapes_model/mm_pipeline_tiny.json",
        "pipeline/tiny/shapes_model/example.png",
        "pipeline/runner/matvec.cpp",
        "pipeline/runner/decode_attention.cpp",
        "pipeline/runner/avx2.h",
    ):
        assert required in names, required
    for package in [*ROOT.glob("pipeline/**/__init__.py"), *ROOT.glob("stages/**/__init__.py")]:
        assert str(package.relative_to(ROOT)) in names, f"{package.parent.name}: add it to pyproject's packages"
    assert not any(n.startswith("tests/") for n in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "+model=qwen3", "--cfg", "job"],
        cwd=elsewhere,
        env=dict(env, PYTHONPATH=str(site)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Qwen/Qwen3-0.6B" in proc.stdout
