"""``python -m pipeline mode=serve`` in a subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]


PORTS_PER_WORKER = 2000  # below Linux's ephemeral range (32768-60999), so no client's socket takes them


def free_port() -> int:
    """A loopback port nothing listens on. Under pytest-xdist, from a range of this worker's own:
    between this check and a server's bind (seconds: it imports torch first) another worker
    could be handed the same port, and its server would answer this worker's health check."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        candidates = [0]  # the kernel picks
    else:
        base = 20000 + PORTS_PER_WORKER * int(worker[2:])
        start = random.randrange(PORTS_PER_WORKER)  # not the port a server just left (TIME_WAIT)
        candidates = [base + (start + i) % PORTS_PER_WORKER for i in range(PORTS_PER_WORKER)]
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in this worker's range ({worker})")


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def serving_tiny(tmp: Path, path: Path, name: str, *overrides: str) -> Iterator[Server]:
    """A float32 server on the tiny model at ``path`` served as ``name``, with that model loaded
    here too (``server.lm``) for the oracle."""
    from pipeline import load_model

    with serving(
        tmp, f"model.path={path}", "model.dtype=float32", "kv.memory=64000000", f"serve.model_name={name}", *overrides
    ) as server:
        server.lm = load_model(str(path), dtype=torch.float32)
        yield server


@contextlib.contextmanager
def serving(tmp: Path, *overrides: str, startup_s: float = 180) -> Iterator[Server]:
    """A server for the given overrides; yields once ``/health`` answers, always stops it."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipeline",
                "mode=serve",
                f"serve.port={port}",
                f"hydra.run.dir={tmp / 'run'}",
                *overrides,
            ],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}):\n{server.stderr()[-3000:]}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up in {startup_s} s:\n{server.stderr()[-3000:]}")
            time.sleep(0.3)
        yield server
    finally:
        server.stop()
