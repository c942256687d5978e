"""The import layering in pyproject.toml ([tool.importlinter]) holds: kv -> runner -> spec ->
engine -> pipeline.pipeline -> stages -> front ends -> modes, and the scheduler imports no torch.
A change that makes a lower layer import a higher one fails here, with import-linter's chain."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# import-linter has no ``python -m`` entry point; this is what its ``lint-imports`` script runs,
# here with this interpreter (a ``lint-imports`` on PATH may belong to another one).
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_import_contracts_kept():
    # The repository's own packages, even where a non-editable copy is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--no-cache"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"lint-imports failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "0 broken" in proc.stdout, proc.stdout  # it read our contracts (not an empty config)
