"""``decode.compile=auto``: the compiled step's graphs built on a thread beside the engine.

The engine decodes eagerly meanwhile and takes the compiled step from the first step after the
build sets ``CompiledStep.ready``. Two things make that safe:

- The build runs its steps on padding rows (``compiled.padding_state``) that write only the
  pool's null block, and Inductor writes a mutated input in place, so the engine's own writes to
  the pool are never touched. Other backends (``aot_eager``) copy a mutated input back whole,
  over what the engine wrote meanwhile: with those the build runs on the calling thread instead.
- A process that exits while the build runs (a one-shot run interrupted, ``serve`` stopped)
  would tear the interpreter down under a thread deep in torch's C++ (a crash, not an exit):
  at exit the build is cancelled (``CompileCancelled``, raised in its thread at its next line of
  Python) and waited for, up to ``EXIT_WAIT_S``.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
from typing import Any, Callable

import torch

from pipeline.kv import BlockPool
from pipeline.runner import matvec
from pipeline.runner.compiled import CompiledStep

EXIT_WAIT_S = 30.0  # a cancelled build stops at its next line of Python: a C++ compile is seconds
THREAD_NAME = "mm-pipeline-compile"


class CompileCancelled(BaseException):
    """Raised in a build's thread as the interpreter exits: not an error (``Exception``s are
    compile failures, which leave the step eager); the build stops and records nothing."""


def start(
    step: CompiledStep, lm: Any, pool: BlockPool, rows: int | None, native: bool, said: Callable[[str], None] | None
) -> threading.Thread | None:
    """Build ``step``'s graphs for ``rows`` sequences (``CompiledStep.build``) under the engine's
    modes, on a thread of its own (returned) or, for a backend other than Inductor, here (None
    returned: built). ``said``: told one line when it ends."""

    done = threading.Event()  # (not ``Thread.is_alive``: see ``_cancel``)

    def build() -> None:
        try:
            with torch.inference_mode(), matvec.active(native):
                seconds = step.build(lm, pool, rows)
        except CompileCancelled:
            return
        finally:
            done.set()
        if said is not None:
            reason = step.why_not(lm)
            said(
                f"decode step compiled in {seconds:.1f} s beside the eager steps: decoding compiled from here"
                if reason is None
                else f"decode step not compiled ({reason}): decoding stays eager"
            )

    if step.backend != "inductor":
        build()
        return None
    thread = threading.Thread(target=build, name=THREAD_NAME, daemon=True)
    thread.start()
    atexit.register(_cancel, thread, done)
    return thread


def _cancel(thread: threading.Thread, done: threading.Event) -> None:
    """At exit: stop ``thread``'s build (module docstring) and wait for it to end. Its own ``done``
    says whether it ended: a ``join`` that Ctrl-C interrupted (the user skipping the compile) marks
    a running thread stopped (Python 3.11, seen here), so ``is_alive`` and ``join`` are not trusted."""
    if done.is_set() or thread.ident is None:
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(CompileCancelled))
    done.wait(EXIT_WAIT_S)
