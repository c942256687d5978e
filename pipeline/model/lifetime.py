"""No orphans: a process started by a launcher ends when its launcher dies, however it dies.

``torchrun`` (and ``accelerate launch`` for several processes, which runs torchrun's agent in its
own process) starts each worker in a session of its own, so neither the terminal's Ctrl-C nor a
kill of the launcher's process group reaches the workers: the launcher forwards SIGINT/SIGTERM
itself and waits for them to drain (torch's ``PContext.close``: up to 30 s, then SIGKILL). A
launcher killed outright (SIGKILL, the out-of-memory killer, a crash) forwards nothing, and its
workers went on serving and holding their port and memory for as long as nobody found them.

Here the kernel is asked to end this process when its parent dies (Linux's
``prctl(PR_SET_PDEATHSIG)``, through ctypes: Python has no wrapper); where that is not offered a
daemon thread watches ``os.getppid()``. Nothing here imports the rest of the project: it runs
first in ``python -m pipeline``, before Hydra or torch load.

PDEATHSIG fires when the *thread* that forked the child ends, not the whole process. torchrun's
agent starts the workers (``SubprocessHandler`` -> ``subprocess.Popen``) from its main thread,
in ``LocalElasticAgent._start_workers`` called by ``_invoke_run`` (restarts too) on the thread
that called ``agent.run()``, which is the launcher's main thread (torch 2.11,
torch/distributed/elastic/{agent/server,multiprocessing}); that thread lives as long as the
launcher, so the signal means "the launcher is gone", never "a helper thread of it ended".

Helpers: the project starts no process of its own (no subprocess or multiprocessing in
pipeline/). torch's compile workers (``decode.compile``: Inductor's ``SubprocPool`` sidecar) end
once this process does: they read EOF on its pipe, and torch's own watch checks their parent.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

# Set in the workers by torchrun's agent (every one of them, also under ``accelerate launch
# --multi_gpu`` and ``--num_processes N``, which run the agent) and by other launchers following
# torch.distributed's environment contract (RANK, LOCAL_RANK: deepspeed, torch.distributed.launch).
LAUNCHER_VARIABLES = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

WATCH_INTERVAL_S = 1.0  # the fallback watch's period: well inside the 10 s a worker may outlive its launcher

# SIGKILL, not SIGTERM and a drain. The launcher dies before its workers only when it was killed
# outright or crashed: Ctrl-C and SIGTERM reach the workers through it, and it waits for their
# drain (``python -m pipeline``'s own handlers, unchanged), so the drain users ask for is never
# cut here. Once it is gone: the ranks of a tensor-parallel group are told at the same moment,
# so rank 0 could not finish a request in flight anyway (its shards are ending too); a rank
# blocked in a collective on a dead peer runs no Python signal handler until the group's timeout
# (30 minutes and more), and serve's drain may be set longer than 10 s. SIGKILL ends the process
# in the kernel, whatever its threads are doing, and the kernel then frees its port and memory
# (GPU memory included: the driver releases a dead process's contexts).
DEATH_SIGNAL = getattr(signal, "SIGKILL", signal.SIGTERM)  # SIGTERM only where SIGKILL does not exist (Windows)


def launched(env: Mapping[str, str] = os.environ) -> bool:
    """Whether a launcher started this process (torchrun's variables are in its environment).

    ``accelerate launch`` of a single process (its simple launcher: no torchrun) is left out on
    purpose: that worker stays in the launcher's process group, so Ctrl-C and a group kill reach
    it directly, and the launcher gives up waiting 0.25 s after a Ctrl-C (``Popen.wait``), so
    binding to it would cut the drain Ctrl-C starts."""
    return any(env.get(name) for name in LAUNCHER_VARIABLES)


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where the
    system does not offer it (not Linux, no libc, or the call refused)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # here: only a Linux launch pays for it

    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the running program's symbols, libc's prctl among them
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def end_now() -> None:
    """End this process as the death signal would: at once, no cleanup that could wait on a peer."""
    os.kill(os.getpid(), DEATH_SIGNAL)
    time.sleep(5)  # the signal is delivered asynchronously (SIGTERM on Windows may be handled)
    os._exit(1)


def watch_parent(parent: int, interval: float = WATCH_INTERVAL_S) -> threading.Thread:
    """Where prctl is not offered: a daemon thread that ends the process once ``os.getppid()`` is
    no longer ``parent`` (an orphan is handed to init or a subreaper). It never blocks exit."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        end_now()

    thread = threading.Thread(target=watch, name="mm-parent-watch", daemon=True)
    thread.start()
    return thread


def end_with_parent() -> None:
    """Tie this process's life to its parent's: PDEATHSIG where offered, else the watch.

    The parent's pid is read first, the signal set, and the pid read again: a parent that died in
    between (its death signal was then sent to nobody) is caught by the second reading. A parent
    dead before the first reading cannot be told from a launcher that is pid 1 (a container's
    entry point) and is not caught; such a worker then fails to join its group (the agent's
    store is gone with the agent)."""
    parent = os.getppid()
    if not set_parent_death_signal(DEATH_SIGNAL):
        watch_parent(parent)
    if os.getppid() != parent:
        end_now()


def end_with_launcher(env: Mapping[str, str] = os.environ) -> None:
    """The CLI's first step: a process a launcher started ends within seconds of the launcher's
    death (any signal, SIGKILL included). A process started by hand is left alone: its parent is
    a shell or a program of the user's, whose death must not take the run with it (``nohup``)."""
    if launched(env):
        end_with_parent()
