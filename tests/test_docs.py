"""The documentation a newcomer meets (issue 49): a README short enough to read, and a docs site
that builds without a warning (a page the nav misses, a broken link, an API reference entry whose
object moved)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    first = re.search(r"```bash\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert first == ['pip install ".[test]" && python -m pipeline', "python -m pytest -q"]


def test_every_docs_page_is_in_the_nav_and_every_relative_link_resolves():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) >= 8 and [p for p in pages if f" {p}" not in nav] == []
    for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which is not there"


def test_the_settings_reference_is_what_the_schema_and_conf_say():
    """docs/settings.md is ``scripts/settings_reference.py``'s output: regenerate it when a setting changes."""
    script = ROOT / "scripts" / "settings_reference.py"
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (ROOT / "docs" / "settings.md").read_text() == run.stdout, (
        "run: python scripts/settings_reference.py > docs/settings.md"
    )
    assert "| `serve.port` | int | `8000` |" in run.stdout and "`decode.cuda_graphs` | bool | `true`" in run.stdout


@pytest.mark.skipif(shutil.which("mkdocs") is None, reason="mkdocs is installed with the test extra")
def test_the_site_builds_strict(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "index.html").read_text().count("load_model") > 1
