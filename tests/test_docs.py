"""The documentation a newcomer meets (issue 49): a README short enough to read, a docs site
that builds without a warning (a page the nav misses, a broken link, an API reference entry whose
object moved), and the commands and Python blocks it shows run as written (every command composes:
tests/test_cli_hygiene.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from doc_commands import Command, documented_commands, python_blocks

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


# --- the documented commands and Python blocks run (issue 49) ------------------------------------

MODES_THAT_WAIT = {"serve", "chat"}  # they answer what stdin or a client sends, not a command line
MODES_THAT_DOWNLOAD = {"eval", "ceval"}  # lm-eval's tasks (from the hub), C-Eval's CSV files


def answered_offline(command: Command) -> bool:
    """A command the embedded default answers offline, on its own: plain ``python -m pipeline``
    (not torchrun or accelerate), no model chosen (``+model=`` and ``model.path=`` name a hub id
    or a folder of the user's), not a mode that waits for input or downloads its tasks."""
    argv = command.argv
    mode = next((a.split("=", 1)[1] for a in argv if a.startswith("mode=")), "run")
    chosen = any(a.startswith(("+model=", "model.path=")) for a in argv)
    return command.launcher == "python" and not chosen and mode not in MODES_THAT_WAIT | MODES_THAT_DOWNLOAD


def runnable_by_page() -> dict[str, list[Command]]:
    """The offline commands of each page, in order, each run once (on the first page showing it)."""
    pages: dict[str, list[Command]] = {}
    seen: set[tuple[str, ...]] = set()
    for command in filter(answered_offline, documented_commands()):
        if tuple(command.argv) not in seen:
            seen.add(tuple(command.argv))
            pages.setdefault(command.page, []).append(command)
    return pages


def make_stand_ins(folder: Path) -> None:
    """The files the commands name that the repository does not ship, made from its examples in
    the folder they run in (``examples/`` is linked there, for the paths into it)."""
    from PIL import Image

    (folder / "examples").symlink_to(ROOT / "examples")
    shutil.copy(ROOT / "examples" / "shapes.png", folder / "my_drawing.png")
    shutil.copy(ROOT / "examples" / "photo.jpg", folder / "photo.jpg")
    shapes = "examples/shapes.png"
    items = [
        {"id": "what", "prompt": "What shapes are in the image?", "images": [shapes]},
        {"id": "count", "prompt": "How many shapes are there?", "images": [shapes]},
    ]
    (folder / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    (folder / "person.json").write_text(json.dumps(person))
    image = Image.open(ROOT / "examples" / "shapes.png").convert("RGB").resize((128, 160))  # even sides for H.264
    frames = [image.rotate(angle, fillcolor="white") for angle in range(0, 40, 5)]  # the shapes turning
    write_clip(folder / "clip.mp4", frames, fps=4)


def write_clip(path: Path, frames: list, fps: int) -> None:
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = *frames[0].size, "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_image(frame)))
        out.mux(stream.encode())


def setting(argv: list[str], key: str) -> str | None:
    return next((a.split("=", 1)[1] for a in argv if a.startswith(f"{key}=")), None)


def run_documented(command: Command, folder: Path, n: int) -> None:
    """Run ``command`` in ``folder``, in a run folder of its own unless it names one, with few new
    tokens unless it sets them; rc 0 and an answer (stdout, or a batch's results) or it fails."""
    argv = command.argv
    if argv and argv[0].startswith("-") and argv[0] != "-m":  # --help, --list-models: as written
        extra = []
    elif "-m" in argv:
        extra = [] if setting(argv, "hydra.sweep.dir") else [f"hydra.sweep.dir=sweep{n}"]
    else:
        extra = [] if setting(argv, "hydra.run.dir") else [f"hydra.run.dir=run{n}"]
        extra += [] if setting(argv, "max_new_tokens") or setting(argv, "mode") == "report" else ["max_new_tokens=16"]
    start = time.monotonic()
    proc = run_cli(*argv, *extra, cwd=folder, timeout=600)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    if setting(argv, "mode") == "batch":
        run_dir = folder / (setting(argv + extra, "hydra.run.dir") or "")
        answers = [json.loads(line)["text"] for line in (run_dir / "results.jsonl").read_text().splitlines()]
        assert any(a.strip() for a in answers), f"{command}: {answers}"  # the toy may end a text prompt at once
    else:
        assert proc.stdout.strip(), f"{command}: nothing on stdout\n{proc.stderr[-3000:]}"
    print(f"{seconds:6.1f} s  {command}")  # shown with -s


@pytest.mark.slow  # 17-20 s a command (a process importing torch), 70 s with decode.compile: 7 minutes in all
@pytest.mark.parametrize("page", sorted(runnable_by_page()))
def test_the_documented_commands_run(page, tmp_path):
    """Each page's commands the embedded default answers offline run as written, in order in one
    folder (bench.md's report reads its sweep), on stand-ins for the files they name."""
    make_stand_ins(tmp_path)
    for n, command in enumerate(runnable_by_page()[page]):
        run_documented(command, tmp_path, n)


def test_the_documented_help_runs(tmp_path):
    """The cheapest documented command, in the default run (3 s: no torch); the README's first,
    ``python -m pipeline``, runs there too (tests/test_shapes.py::test_first_run_asks_about_the_example_image)."""
    (help_command,) = {tuple(c.argv): c for c in documented_commands() if c.argv == ["--help"]}.values()
    run_documented(help_command, tmp_path, 0)


# Put in a block of docs/python-api.md that the embedded default cannot run on the CPU (a GPU,
# a hub model), this comment makes the test skip that block, saying why.
NOT_RUN = "# not run by tests/test_docs.py: "


def test_the_python_api_page_runs(monkeypatch, capsys):
    """docs/python-api.md's Python blocks, in order in one namespace (the later ones use the
    earlier ones' names), from the repository's root, on the embedded default."""
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": "python_api_page"}
    blocks = python_blocks(ROOT / "docs" / "python-api.md")
    assert len(blocks) >= 2
    for line, source in blocks:
        if NOT_RUN in source:
            pytest.skip(f"docs/python-api.md:{line}: {source.split(NOT_RUN, 1)[1].splitlines()[0]}")
        exec(compile(source, f"docs/python-api.md:{line}", "exec"), namespace)
        assert capsys.readouterr().out.strip(), f"the block at docs/python-api.md:{line} printed nothing"
