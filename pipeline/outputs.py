"""Writing results so that a file on disk is either complete or absent, never half-written."""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig


def write_json(path: str | Path, data: Any) -> Path:
    """Write via a temp file + rename: a crash leaves the old file or none, never a partial one."""
    return write_text(path, json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def write_text(path: str | Path, text: str) -> Path:
    """Write via a temp file + rename, like write_json (which uses it); for reports, CSV, JSONL."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_csv(path: str | Path, rows: list[list[Any]]) -> Path:
    """Rows (the header first) as RFC 4180 CSV, written atomically."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return write_text(path, buf.getvalue())


def write_jsonl(path: str | Path, records: list[Any]) -> Path:
    """One JSON object per line, written atomically (the final, ordered results of a batch)."""
    return write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def save_figure(fig: Any, path: str | Path, dpi: int = 100) -> Path:
    """Save a matplotlib figure via a temp file + rename, like every other result file."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")  # keep the suffix: it picks the format
    fig.savefig(tmp, dpi=dpi)
    os.replace(tmp, path)
    return path


def append_jsonl(path: str | Path, record: Any) -> None:
    """Append one line and fsync, so each finished item survives a crash of the process."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_dir() -> Path:
    """The Hydra run folder of this job (the current folder outside Hydra)."""
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return Path.cwd()
