"""One style, checked: ``ruff check`` (pycodestyle errors and warnings, pyflakes, 120 columns) and
``ruff format --check`` over the whole tree, as configured in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is installed with the test extra")
@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]])
def test_the_tree_is_clean(command):
    run = subprocess.run([RUFF, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
