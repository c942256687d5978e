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
  Python) and waited for, up to ``EXIT_WAIT_S``. A line of Python that swallows what it raises
  (a weakref callback, a ``__del__``: CPython reports those as "unraisable" and goes on) lets the
  build run on, so the cancel is raised again until the build ends, and unraisable reports of it
  are kept off stderr.

For ``chat`` a first compile runs in a process of its own (``pipeline.runner.compile_apart``)
and the thread then builds from Inductor's caches.

Two more things keep the engine's answers coming while the thread builds:

- While a build runs, Python hands the GIL over every ``SWITCH_S`` instead of every 5 ms
  (``_fair_gil``). An eager step lets go of the GIL in each of its few hundred torch calls and
  must then wait for the build's thread, deep in Dynamo's tracing, to hand it back: up to 5 ms
  a wait, so a server's first answer took 16 s and one 26 s.
- Torch.fx's symbolic tracer patches ``torch.nn.Module.__call__`` for the whole process while it
  traces, and a module called from another thread meanwhile fails ("module is not installed as a
  submodule"). Inductor traces once per process that way (``trace_fx_once``); the runner of an
  auto step has it done as it is made, before its engine's first step.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch

from pipeline.kv import BlockPool
from pipeline.runner import compile_apart, matvec
from pipeline.runner.compiled import CompiledStep
from pipeline.runner.inductor_cache import compile_record

EXIT_WAIT_S = 30.0  # a cancelled build stops at its next line of Python: a C++ compile is seconds
RETRY_S = 0.2  # how long a raised cancel has to end the build before it is raised again
THREAD_NAME = "mm-pipeline-compile"
NICE = 10  # how far below the engine's CPU priority the build runs (``_yield_to_engine``)
SWITCH_S = 1e-4  # Python's GIL switch interval while a build runs (``_fair_gil``)
_fair = {"builds": 0, "before": 0.005}  # builds under ``_fair_gil`` now; the interval they replaced
_fair_lock = threading.Lock()


class CompileCancelled(BaseException):
    """Raised in a build's thread as the interpreter exits: not an error (``Exception``s are
    compile failures, which leave the step eager); the build stops and records nothing."""


def start(
    step: CompiledStep,
    lm: Any,
    pool: BlockPool,
    rows: int | None,
    native: bool,
    said: Callable[[str], None] | None,
    apart: bool = False,
) -> threading.Thread | None:
    """Build ``step``'s graphs for ``rows`` sequences (``CompiledStep.build``) under the engine's
    modes, on a thread of its own (returned) or, for a backend other than Inductor, here (None
    returned: built). ``said``: told one line when it ends. ``apart``: a first compile runs in a
    process of its own (``compile_apart``) and the thread then builds from Inductor's caches."""

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

    def run() -> None:
        try:
            if apart:  # (before this thread's priority drops: the child sets its own)
                _warm_apart(step, lm, pool, rows, native)
        except CompileCancelled:
            done.set()
            return
        _yield_to_engine()
        with _fair_gil():
            build()

    thread = threading.Thread(target=run, name=THREAD_NAME, daemon=True)
    thread.start()
    atexit.register(_cancel, thread, done)
    return thread


def _warm_apart(step: CompiledStep, lm: Any, pool: BlockPool, rows: int | None, native: bool) -> None:
    """A first compile built in a process of its own (``compile_apart``), where it can be. It
    only fills Inductor's caches: where it cannot even start (a spec that does not pickle, no
    process to spare), the thread that calls this builds from nothing, as without it."""
    if "first_s" not in compile_record(step.key(lm, pool, rows)) and compile_apart.why_not(lm) is None:
        try:
            compile_apart.build(step, lm, pool, rows, native)
        except Exception:  # (not the exit's CompileCancelled: the caller stops)
            pass


def _yield_to_engine() -> None:
    """Lower the calling thread's CPU priority by ``NICE`` (Linux sets it per thread; the compiler
    processes it starts inherit it), so that the engine's steps come first where they compete
    for cores. Measured (187M Llama, 2 cores, 32-token answers back to back while the first
    compile ran): 131 answers in its 110 s, median 0.64 s, against 20 in 53 s, median 1.85 s; an
    idle machine builds as fast either way. Elsewhere (no per-thread priority) nothing changes."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICE)
    except (AttributeError, OSError):
        pass


@contextlib.contextmanager
def _fair_gil() -> Iterator[None]:
    """Python's GIL switch interval at ``SWITCH_S`` while any build runs (module docstring).
    Measured (254M Llama, 2 cores, a fresh Inductor cache, a server answering 64 tokens back to
    back to the ``openai`` client, alternating): first answer 6.2-6.5 s against 15.6-15.8 s at
    5 ms, the slowest 7.1-7.4 s against 24-26 s, the switch to the compiled step after 99-103 s
    against 91-97 s. 10 us answered first in 4.2-6.0 s but switched after 106-127 s. On an idle
    server nothing waits for the GIL, so nothing is handed over."""
    with _fair_lock:
        if _fair["builds"] == 0:
            _fair["before"] = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_S)
        _fair["builds"] += 1
    try:
        yield
    finally:
        with _fair_lock:
            _fair["builds"] -= 1
            if _fair["builds"] == 0:
                sys.setswitchinterval(_fair["before"])


def trace_fx_once() -> None:
    """Inductor's one symbolic trace a process (module docstring), done now, before any build
    beside an engine. Where a newer torch has no such trace, nothing is done."""
    try:
        from torch._inductor.loop_body import InterpreterShim

        InterpreterShim._dummy_gm()
    except (ImportError, AttributeError):
        pass


def _cancel(thread: threading.Thread, done: threading.Event) -> None:
    """At exit: stop ``thread``'s build (module docstring) and wait for it to end. Its own ``done``
    says whether it ended: a ``join`` that Ctrl-C interrupted (the user skipping the compile) marks
    a running thread stopped (Python 3.11, seen here), so ``is_alive`` and ``join`` are not trusted."""
    if done.is_set() or thread.ident is None:
        return
    _quiet_unraisable_cancels()
    deadline = time.monotonic() + EXIT_WAIT_S
    while True:
        _raise_in(thread, CompileCancelled)
        if done.wait(RETRY_S) or time.monotonic() > deadline:
            break
    _raise_in(thread, None)  # a cancel raised as the build ended must not reach what runs next


def _raise_in(thread: threading.Thread, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in ``thread`` at its next line of Python (None: drop one not yet raised)."""
    ident = ctypes.c_ulong(thread.ident)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ident, ctypes.py_object(exc) if exc else None)


def _quiet_unraisable_cancels() -> None:
    """Keep a cancel that a callback swallowed off stderr; other unraisable errors are reported."""
    report = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, CompileCancelled):
            report(unraisable)

    sys.unraisablehook = hook
