"""``benchmarks/recurrent.py`` (recurrent-state checkpoints on a Qwen3.5-style hybrid model) on a
miniature model: every answer it times must equal ``generate()`` or it exits non-zero, and its
figures are written. Timings are never asserted; only what the engine must do whatever the speed:
a rollback with checkpoints recomputes less than one without, and with checkpoints "off" a request
branching from an earlier one inside its prompt reuses nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_quick_run_keeps_generate_tokens(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "recurrent.py"),
            "--quick",
            "--cache-dir",
            str(tmp_path),
            "--json",
            str(tmp_path / "recurrent.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| off |" in out.stdout and "tokens = generate()" in out.stdout
    figures = json.loads((tmp_path / "recurrent.json").read_text())
    assert figures["checked"] > 0 and figures["mismatches"] == []
    rollback = {r["every"]: r for r in figures["rollback"]}
    assert rollback["16"]["recomputed_mean"] < rollback["off"]["recomputed_mean"]
    assert rollback["16"]["state_bytes"] > rollback["off"]["state_bytes"]
    branch = {r["every"]: r for r in figures["prefix"] if r["case"] == "branch"}
    assert branch["off"]["reused"] == 0 and branch["16"]["reused"] > 0
