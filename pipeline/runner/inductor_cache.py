"""What a compiled step's warm-up keeps on disk between processes: Inductor's caches in a folder
the project names, and Inductor's per-process checks of the C++ compiler.

A second process compiling the same model finds its graphs in Inductor's caches, but each process
still checks, once per vector instruction set, that the compiler builds it: Inductor compiles a
probe (cached) and then loads it in a fresh ``python -c "import torch ..."`` (not cached), about
1.5 s each, six on an AVX-512 BF16 CPU. That was 9 of a 30 s warm-up on the 187M Llama, 2 cores
(measured: 30.1 s -> 17.7 s with the answers kept). ``remember_isa_checks`` keeps the passed
checks in the cache folder, keyed by Inductor's own fingerprint of the check (compiler version,
flags, probe source) plus torch's version and the interpreter; a failed check is asked again.

The folder also records which compiled steps were built with it and what they cost
(``remember``): a one-shot run with ``decode.compile=auto`` waits for a compile only when
Inductor will find it there (``compile_record``; 3.4-3.6 s for the 187M Llama's batch-of-one
graph) and the wait is shorter than its answer would take eagerly, never for a first compile.
The record lives beside the graphs, so emptying the folder forgets both.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import threading
from pathlib import Path
from typing import Any, Iterable

import torch

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
ISA_FILE = "mm-pipeline-isa-checks.json"
COMPILED_FILE = "mm-pipeline-compiled.json"
CACHED_RUNS = 5  # the cached builds a record keeps (``remember_cached``)


def use_project_cache() -> str | None:
    """Inductor's on-disk caches (compiled graphs, autotuning) in mm-pipeline's own folder,
    ``$XDG_CACHE_HOME/mm-pipeline/torchinductor`` (``~/.cache/...``), unless the user named one
    (``TORCHINDUCTOR_CACHE_DIR``); the compiler checks are remembered there too. Why: torch's
    default lies in /tmp, emptied at reboot, and a warm-up that finds its graphs there is a third
    of one that compiles them (a 187M Llama on 2 cores: 20.8 s against 60.0 s). Importing
    ``torch._dynamo`` writes torch's default into the variable, so a value equal to the default
    is taken as unset. Inductor reads the variable each time it looks for a graph. Returns the
    folder in use (None: torch's default, the folder could not be made)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    named = os.environ.get(CACHE_ENV)
    if named and named != default_cache_dir():
        remember_isa_checks(Path(named))
        return named
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mm-pipeline" / "torchinductor"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    os.environ[CACHE_ENV] = str(folder)
    remember_isa_checks(folder)
    return str(folder)


def remember_isa_checks(folder: Path) -> bool:
    """Inductor's compiler check (``VecISA.check_build``) answered from ``folder/ISA_FILE`` where a
    process with the same compiler, flags and torch passed it before (module docstring). Returns
    whether the check is wrapped (False: this torch has no such check; nothing changes)."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return False
    isa = getattr(cpu_vec_isa, "VecISA", None)
    fingerprint = getattr(cpu_vec_isa, "_get_isa_dry_compile_fingerprint", None)
    original = getattr(isa, "check_build", None)
    if original is None or fingerprint is None:
        return False
    original = getattr(original, "__wrapped_check__", original)
    path = folder / ISA_FILE

    def check_build(self: Any, code: str) -> bool:
        flags = getattr(self, "_arch_flags", "")
        parts = (torch.__version__, sys.executable, flags, fingerprint(flags), code)
        key = hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()
        if key in _read(path):
            return True
        passed = original(self, code)
        if passed:
            _write(path, {**_read(path), key: True})
        return passed

    check_build.__wrapped_check__ = original  # type: ignore[attr-defined]
    isa.check_build = check_build
    return True


def source_digest(paths: Iterable[Path]) -> str:
    """A digest of what the files at ``paths`` say (in sorted order): a cache key part that an
    edit of the code a graph is traced from changes."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def compile_record(key: str) -> dict[str, Any]:
    """What this cache folder knows of the compiled step ``key`` (``CompiledStep.key``: model
    shapes, dtypes, scheme, torch): ``first_s``, the seconds its first compile took (present once
    Inductor's caches hold its graphs); ``cached_s``, the median of the last builds that found
    them there (``cached_runs``, ``remember_cached``);
    ``eager_token_s``, the seconds an eager decode step of it took; ``failed_s``, how long a
    compile of it ran before it failed (``decode.compile=auto`` then stays eager). Empty: nothing, or no folder
    is named (``use_project_cache`` could not make one). Why: a one-shot run waits only for a
    cached compile, and only where that wait is shorter than its answer would take eagerly."""
    entry = recall(COMPILED_FILE).get(key)
    return entry if isinstance(entry, dict) else {}


def failed_before(record: dict[str, Any]) -> bool:
    """Whether ``record`` (``compile_record``) says the step's compile failed here and never
    built since: ``decode.compile=auto`` does not try it again."""
    return "failed_s" in record and "first_s" not in record


def remember(key: str, **figures: float | list[float]) -> None:
    """Add ``figures`` (``compile_record``'s names) to what is known of ``key``."""
    rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}
    keep(COMPILED_FILE, key, {**compile_record(key), **rounded})


def remember_cached(key: str, seconds: float) -> None:
    """A build of ``key`` that found its graphs cached took ``seconds``: ``cached_s`` becomes the
    median of the last ``CACHED_RUNS``. Why not the last alone: one build slowed by a profiler or a
    busy machine (36.7 s under ``py-spy`` against 9.6) then turned off a one-shot run's wait for
    every answer shorter than that."""
    before = compile_record(key).get("cached_runs")
    runs = [*(before if isinstance(before, list) else []), round(seconds, 4)][-CACHED_RUNS:]
    remember(key, cached_s=statistics.median(runs), cached_runs=runs)


def recall(name: str) -> dict:
    """The JSON object in the cache folder's file ``name`` (empty: none, or no folder is named)."""
    folder = os.environ.get(CACHE_ENV)
    return _read(Path(folder) / name) if folder else {}


def keep(name: str, key: str, value: Any) -> None:
    """``value`` under ``key`` in the cache folder's file ``name`` (nothing where no folder is named)."""
    folder = os.environ.get(CACHE_ENV)
    if folder:
        path = Path(folder) / name
        _write(path, {**_read(path), key: value})


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    """``data`` as JSON (``write_whole``: where the folder is unwritable, the checks then run each
    time, as torch's own do)."""
    write_whole(path, json.dumps(data).encode())


def write_whole(path: Path, data: bytes) -> None:
    """``data`` at ``path`` whole or not at all: another process may read it meanwhile. The part
    file is named by process and thread, and made with the umask's mode, as Inductor's own files
    are. An unwritable folder is left alone (what this cache would have kept is made again)."""
    part = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        part.write_bytes(data)
        os.replace(part, path)
    except OSError:
        part.unlink(missing_ok=True)
