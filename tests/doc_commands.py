"""The ``python -m pipeline`` commands and the Python blocks the documentation shows (README.md,
CONTRIBUTING.md, docs/*.md), read from its code: fenced blocks, indented blocks and inline code
spans (prose outside code is not read), backslash continuations joined. tests/test_cli_hygiene.py
composes every command, tests/test_docs.py runs those the embedded default answers offline."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

# Where a command's words end: a shell operator (a redirection, a pipe, the next command).
SHELL_OPERATORS = {">", ">>", "2>", "2>&1", "|", "&&", "||", ";", "&"}
# The placeholder rule: `...` (a word, or a value: system_prompt="...") stands for "what you
# would write" and is left out of the command; every other value in a documented command is
# one a user could type (DIR, img.jpg: they compose as strings). `<hub id>`-style placeholders
# are not used: the shell would read them as redirections (asserted by test_cli_hygiene).
PLACEHOLDER = "..."


@dataclass(frozen=True)
class Command:
    """One documented command: where it is, the text after ``-m pipeline`` as written, and what
    launches it (``python``, ``torchrun --nproc-per-node 2``, ``accelerate launch ...``)."""

    page: str
    line: int
    launcher: str
    text: str

    @property
    def argv(self) -> list[str]:
        """Its arguments up to the first shell operator or comment, placeholders left out."""
        words = []
        for word in shlex.split(self.text, comments=True):
            if word in SHELL_OPERATORS:
                break
            if word != PLACEHOLDER and not word.endswith("=" + PLACEHOLDER):
                words.append(word)
        return words

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.launcher} -m pipeline {self.text}".rstrip()


def code_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, code) of a page: each line of a fenced or indented block (continuations
    joined, numbered by their first line), and each inline code span of the other lines."""
    out: list[tuple[int, str]] = []
    lines = page.read_text().splitlines()
    fenced, indented, blank_before = False, False, True
    n = 0
    while n < len(lines):
        start, line = n + 1, lines[n]
        while line.endswith("\\") and n + 1 < len(lines):
            n += 1
            line = line[:-1] + " " + lines[n].strip()
        n += 1
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            out.append((start, line))
        elif line.startswith("    ") and (indented or blank_before):
            indented = True
            out.append((start, line))
        else:
            indented = indented and not line.strip()  # a blank line inside an indented block
            out += [(start, span) for span in re.findall(r"`([^`]+)`", line)]
        blank_before = not line.strip()
    return out


def documented_commands() -> list[Command]:
    """Every ``-m pipeline`` command of the documentation, in page order."""
    found = []
    for page in PAGES:
        for number, code in code_lines(page):
            for match in re.finditer(r"(\S+(?: [^|&;]*?)?) -m pipeline(?![\w.])(.*)", code):
                launcher = match.group(1).split("&&")[-1].split("|")[-1].strip().removeprefix("$ ")
                text = match.group(2).strip()
                found.append(Command(str(page.relative_to(ROOT)), number, launcher, text))
    return found


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(first line, source) of each fenced ```python block of a page."""
    text = page.read_text()
    blocks = re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in blocks]
