"""Writing results so that a file on disk is either complete or absent, never half-written."""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


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


# Output folders as they were before this process started: path -> its entries, or None where the
# folder did not exist yet (so this run created it). Filled by RunFolders, read by remove_failed_run_dir.
_BEFORE: dict[Path, set[str] | None] = {}


def _note_folder(config: DictConfig, key: str) -> None:
    try:
        path = Path(os.path.abspath(str(config.hydra[key].dir)))  # ${now:...} is cached: the job gets the same
    except Exception:  # a folder only the job can resolve: unknown, so never removed
        return
    _BEFORE[path] = {p.name for p in path.iterdir()} if path.is_dir() else None
    for parent in path.parents:  # outputs/DATE: created with the run's folder when it is the day's first
        if parent.exists():
            break
        _BEFORE[parent] = None


class RunFolders(Callback):
    """Hydra callback (conf/config.yaml ``hydra.callbacks``): notes which output folders already
    existed before Hydra creates the run's, so that a failed run removes only what it created."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _note_folder(config, "run")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _note_folder(config, "sweep")


_UNKNOWN = object()


def _entries_before(path: Path) -> Any:
    """The names ``path`` held before this run, None where this run created it, _UNKNOWN if unsure."""
    if path in _BEFORE:
        return _BEFORE[path]
    if path.parent in _BEFORE:  # a sweep's job folder: new unless the sweep's folder already held it
        before = _BEFORE[path.parent]
        return None if before is None or path.name not in before else _UNKNOWN
    return _UNKNOWN


def _file_handlers_in(path: Path) -> list[logging.FileHandler]:
    return [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == path
    ]


def remove_failed_run_dir() -> None:
    """A run that fails before writing any result leaves nothing behind: what it added to the Hydra
    run folder is removed when that is only Hydra's ``.hydra/`` and the job's log, and the folder
    with it when this run created it. A folder that existed before keeps what it held; one that
    holds anything else this run wrote (results) is kept whole. The folders this run created above
    it (a sweep's, ``outputs/DATE``) go too when the failed job was all they held."""
    try:
        hydra = HydraConfig.get()
    except ValueError:  # outside Hydra
        return
    path = Path(hydra.runtime.output_dir)
    before = _entries_before(path)
    if before is _UNKNOWN or not path.is_dir():
        return
    added = {p.name for p in path.iterdir()} - (before or set())
    saved = path / str(hydra.output_subdir)
    if not added <= {f"{hydra.job.name}.log", str(hydra.output_subdir)} or (
        saved.name in added and not {p.name for p in saved.iterdir()} <= {"config.yaml", "hydra.yaml", "overrides.yaml"}
    ):
        return
    for handler in _file_handlers_in(path):  # a record logged later must not recreate the file
        logging.getLogger().removeHandler(handler)
        handler.close()
    _remove(path, before, added)
    for parent in path.parents:  # a sweep's folder, outputs/DATE: what this run created there, once that is all
        if parent not in _BEFORE or not parent.is_dir():
            break
        before = _BEFORE[parent]
        added = {p.name for p in parent.iterdir()} - (before or set())
        if not added <= {"multirun.yaml"}:
            break
        _remove(parent, before, added)
        if before is not None:
            break


def _remove(path: Path, before: set[str] | None, added: set[str]) -> None:
    """Remove the folder this run created, or from one that existed, what this run added."""
    if before is None:
        shutil.rmtree(path, ignore_errors=True)
        return
    for name in added:
        shutil.rmtree(path / name, ignore_errors=True) if (path / name).is_dir() else (path / name).unlink(
            missing_ok=True
        )


class _Mirror:
    """sys.stderr that also appends each finished line to the job's log file (a progress bar's
    redrawn line, ``\\r``-separated, is logged in its last state only)."""

    def __init__(self, stream: Any, handler: logging.FileHandler) -> None:
        self._stream, self._handler, self._line = stream, handler, ""

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        with self._handler.lock:  # threads (serve) keep their lines whole
            *lines, self._line = (self._line + text).split("\n")
            if lines:
                self._log("".join(line.rsplit("\r", 1)[-1] + "\n" for line in lines))
        return n

    def _log(self, text: str) -> None:
        with self._handler.lock:
            if self._handler.stream is not None:
                self._handler.stream.write(text)
                self._handler.stream.flush()

    def close_line(self) -> None:
        if self._line.rsplit("\r", 1)[-1].strip():
            self._log(self._line.rsplit("\r", 1)[-1] + "\n")
        self._line = ""

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the real stderr's
        return getattr(self._stream, name)


@contextmanager
def stderr_to_log() -> Iterator[None]:
    """Within a Hydra job, the run's log file (``__main__.log`` in the run folder, from Hydra's
    job_logging ``file`` handler) gets what the user sees on stderr: the notes, warnings, the
    placement, the metrics table, an ``error:`` line. The project reports with prints to stderr, not
    log records, so the handler alone would leave the file empty. Libraries' own log handlers
    (transformers') write there too. Outside Hydra, or with no file handler, nothing changes."""
    handlers = _file_handlers_in(run_dir()) if HydraConfig.initialized() else []
    if not handlers:
        yield
        return
    handler = handlers[0]
    libraries = [
        lg
        for lg in logging.Logger.manager.loggerDict.values()
        if isinstance(lg, logging.Logger) and lg.handlers and not lg.propagate
    ]
    for lg in libraries:
        lg.addHandler(handler)
    mirror = sys.stderr = _Mirror(sys.stderr, handler)
    try:
        yield
    finally:
        sys.stderr = mirror._stream
        mirror.close_line()
        for lg in libraries:
            lg.removeHandler(handler)
