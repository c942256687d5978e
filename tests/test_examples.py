"""The shipped examples run as written (on the embedded default model)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_custom_workflow_branches_from_one_prefill():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_workflow.py")], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "[greedy]" in proc.stdout and "[creative]" in proc.stdout
    assert "greedy branch == plain pipeline run: OK" in proc.stdout
