"""``decode.compile=auto`` beside a chat's engine: the first compile in a process of its own.

A build on a thread beside the engine shares the interpreter with it. An eager step lets go of
the GIL in each of its few hundred torch calls and waits for the build's thread to hand it back,
so while Dynamo traces, every answer is slower (a fresh server's first answer: 5.5-6.5 s, against
1.3-1.7 s with nothing beside it; 254M Llama, 2 cores). A second process shares no lock.

Where Inductor's on-disk caches do not hold the step yet, a child process (``python -m
pipeline.runner.compile_apart SPEC``) loads the same checkpoint with the same
``from_pretrained`` arguments, makes a pool of the same shape (never written but for its null
block, so its pages are hardly touched: ``torch.empty``) and builds the step there, into the
same caches. The engine's thread then builds from them in seconds. The child only warms the
caches: where it fails, is stopped, or builds graphs of another key, the thread compiles as it
did before, so the tokens never depend on it. It runs only on idle CPU (``_lowest_priority``),
in the engine's session (``GROUP``), and ends with its parent (a parent-death signal, and a check
that its parent is still the one that started it). An engine kept busy starves it
(``starved``), so only ``chat`` asks for it (``Pipeline.compile_ahead(apart=True)``).
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.memory import free_bytes
from pipeline.runner.inductor_cache import compile_record

POLL_S = 0.2  # how often the waiting thread runs a line of Python (where an exit's cancel is raised)
NICE = 10  # the child's CPU priority where Linux's SCHED_IDLE is missing (``_lowest_priority``)
STARVED_S, STARVED_SHARE = 20.0, 0.25  # a child with less than this share of a core this long is stopped
SAMPLE_S = 1.0  # how often the child's CPU time is read
# The child leads a process group of its own (killed whole: the compilers it started too), in
# the engine's session: Linux shares CPU time fairly between sessions (autogroups), so in a
# session of its own the child took half the CPU whatever its priority, and answers were 10-20x
# slower. (``process_group`` is Python 3.11's; before it the child alone is killed.)
GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {}
# The child starts only where free RAM holds twice the weights (loading may hold the checkpoint's
# dtype beside the quantised copy) and this much more
MARGIN = 1 << 30


@dataclass
class Spec:
    """What the child needs to build the graphs the parent's thread would: the same model loaded
    alike (``LoadedModel.source``), a pool of the same shape, the same step and modes."""

    path: str
    auto_class: str
    load_kwargs: dict
    pool: dict
    backend: str
    mode: str | None
    rows: int | None
    native: bool
    threads: int
    key: str  # the parent's ``CompiledStep.key``: the child builds only if its own is the same
    parent: int = field(default_factory=os.getpid)


def why_not(lm: Any) -> str | None:
    """Why the first compile of ``lm``'s step stays on the thread (None: it can go apart)."""
    if not getattr(lm, "source", None):
        return "not loaded by load_model"
    if lm.device.type != "cpu":
        return "not on CPU"
    if getattr(lm, "adapters", None):
        return "LoRA adapters loaded"
    weights = sum(sum(kinds.values()) for kinds in (lm.placement or {}).values())
    if free_bytes(lm.device, lm)[0] < 2 * weights + MARGIN:
        return "too little RAM free to load the weights again"
    return None


def spec_for(step: Any, lm: Any, pool: Any, rows: int | None, native: bool) -> Spec:
    """The child's orders for building ``step``'s graphs for ``rows`` on ``lm`` and ``pool``."""
    return Spec(
        path=lm.path,
        auto_class=lm.source["auto_class"],
        load_kwargs=lm.source["kwargs"],
        pool=dict(
            num_blocks=pool.num_blocks,
            block_size=pool.block_size,
            dtype=pool.dtype,
            devices=[str(d) for d in pool.devices],
            attention=pool.attention,
            shards=pool.shards,
            kv_dtype=pool.kv_dtype,
        ),
        backend=step.backend,
        mode=step.mode,
        rows=rows,
        native=native,
        threads=torch.get_num_threads(),
        key=step.key(lm, pool, rows),
    )


def build(step: Any, lm: Any, pool: Any, rows: int | None, native: bool) -> bool:
    """Build ``step``'s graphs in a child process (module docstring) and wait for it; returns
    whether Inductor's caches now hold them. A child that a busy engine starves (``starved``) is
    stopped, and the caller builds on its thread. The wait runs a line of Python every
    ``POLL_S``, so an exit's ``CompileCancelled`` reaches it; the child and whatever it started
    (``GROUP``) are killed on the way out."""
    spec = spec_for(step, lm, pool, rows, native)
    with tempfile.TemporaryDirectory(prefix="mm-pipeline-compile-") as folder:
        path = Path(folder) / "spec.pkl"
        path.write_bytes(pickle.dumps(spec))
        quiet = subprocess.DEVNULL
        child = subprocess.Popen(command(path), stdin=quiet, stdout=quiet, stderr=quiet, **GROUP)
        try:
            _lowest_priority(child.pid)  # now, not after its imports: those are seconds of CPU
            samples: list[tuple[float, float]] = []  # (monotonic seconds, the group's CPU seconds)
            while child.poll() is None and not starved(child.pid, samples):
                time.sleep(POLL_S)
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL) if GROUP else child.kill()
                # reaped on a thread: at its idle priority the child takes its time to exit (up
                # to 30 s beside a busy engine, measured), and nothing here needs it gone
                threading.Thread(target=child.wait, name="mm-pipeline-reap", daemon=True).start()
    return "first_s" in compile_record(spec.key)


def command(spec_path: Path) -> list[str]:
    """The child's command line (``main``)."""
    return [sys.executable, "-m", "pipeline.runner.compile_apart", str(spec_path)]


def starved(child: int, samples: list[tuple[float, float]]) -> bool:
    """Whether ``child`` and the processes of its group got less than ``STARVED_SHARE`` of a
    core over the last ``STARVED_S`` (``samples``: kept by the caller, one added every
    ``SAMPLE_S``). Why: beside an engine that keeps both cores busy (254M Llama, answers back to
    back) the child got about a quarter of a core, a compile of minutes; the thread's build,
    slower answers and all, switches within two minutes there."""
    now = time.monotonic()
    if samples and now - samples[-1][0] < SAMPLE_S:
        return False
    cpu = group_cpu_s(child)
    samples.append((now, cpu))
    while len(samples) > 1 and samples[1][0] <= now - STARVED_S:
        samples.pop(0)
    then, before = samples[0]
    return now - then >= STARVED_S and cpu - before < STARVED_SHARE * (now - then)


def group_cpu_s(child: int) -> float:
    """CPU seconds of ``child`` and the processes of its group, and of the children they have
    waited for (Linux ``/proc``; 0 elsewhere, where nothing then counts as starved)."""
    ticks = 0
    try:
        entries = os.scandir("/proc")
    except OSError:
        return 0.0
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # ended meanwhile
            if entry.name == str(child) or int(fields[2]) == child:  # fields: state, ppid, pgrp, ... utime at [11]
                ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def main(spec_path: str) -> int:
    """The child: load, check the key, build (exit 0: built; else not, and the parent builds)."""
    from pipeline.model.lifetime import set_parent_death_signal

    spec: Spec = pickle.loads(Path(spec_path).read_bytes())
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != spec.parent:  # the parent ended before the signal was set
        return 1
    torch.set_num_threads(spec.threads)
    lm, pool, step = _rebuild(spec)
    gc.freeze()  # what the imports and the load made lives as long as this process (``__main__.settle_imports``)
    if step is None or step.key(lm, pool, spec.rows) != spec.key:
        return 2
    from pipeline.runner import matvec
    from pipeline.runner.attention import attach

    attach(lm.model)
    with torch.inference_mode(), matvec.active(spec.native):
        step.build(lm, pool, spec.rows)
    return 0 if step.broken is None else 3


def _lowest_priority(pid: int) -> None:
    """The child ``pid``, and the threads and compilers it starts from then on, runs only where a
    core is idle: Linux's ``SCHED_IDLE``, which the engine's threads preempt at once when they
    wake. A nice value does not do that: at nice 10 the child kept a core for whole time slices
    while the engine's second OpenMP thread waited to wake on it, and each answer took 30 s
    instead of 1.3 s (254M Llama, 2 cores). Elsewhere, ``NICE``. Set by the parent as soon as the
    child starts: set by the child itself, it came after its imports (torch, transformers: 8 s of
    CPU), at the engine's priority while a fresh server answered its first requests."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, pid, max(NICE, os.getpriority(os.PRIO_PROCESS, pid)))


def _rebuild(spec: Spec) -> tuple[Any, Any, Any]:
    """The parent's model, pool and auto step, made alike here (the step None: auto would not
    compile here)."""
    import transformers

    from pipeline.families import family_for_config
    from pipeline.kv import BlockPool
    from pipeline.model.loading import LoadedModel
    from pipeline.model.quant import scheme_in_force
    from pipeline.runner.compiled import CompiledStep
    from pipeline.runner.model_runner import ModelRunner

    model = getattr(transformers, spec.auto_class).from_pretrained(spec.path, **spec.load_kwargs).eval()
    family = family_for_config(model.config)
    lm = LoadedModel(model, None, None, family, spec.path, quant=scheme_in_force(model))
    pool = BlockPool(model.config, **{**spec.pool, "devices": [torch.device(d) for d in spec.pool["devices"]]})
    step = CompiledStep(spec.backend, spec.mode, auto=True)
    runner = ModelRunner(lm, pool, step, native=spec.native)
    return lm, pool, runner.compiled


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
