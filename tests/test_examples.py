"""The shipped examples run as written (on the embedded default model), in this process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_workflow_branches_from_one_prefill(capsys):
    """With no arguments it asks the embedded default its own question about its example image:
    both branches answer (a text prompt got an immediate EOS and two empty branches)."""
    texts = load_example("custom_workflow").main([])
    out = capsys.readouterr().out
    assert set(texts) == {"greedy", "creative"}
    for name, text in texts.items():
        assert text.strip(), f"the {name} branch answered nothing"
        assert any(kind in text for kind in ("circle", "square", "triangle")), text
    assert "[greedy]" in out and "[creative]" in out
    assert "greedy branch == plain pipeline run: OK" in out
