"""``decode.compile=auto`` beside a serving engine: the first compile in a process of its own
(``pipeline.runner.compile_apart``), given up where a busy engine starves it, never started where
a second copy of the weights would not fit. The compile itself, end to end: test_auto_compile.py."""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from pipeline.runner import compile_apart


def fake_lm(**kw):
    lm = SimpleNamespace(
        source={"auto_class": "AutoModelForCausalLM", "kwargs": {}},
        device=torch.device("cpu"),
        adapters={},
        placement={"cpu": {"int8": 1 << 30}},
        max_memory={},
    )
    lm.__dict__.update(kw)
    return lm


def test_the_child_is_started_only_where_it_can_load_the_model_alike_and_it_fits(monkeypatch):
    free = {"bytes": 8 << 30}
    monkeypatch.setattr(compile_apart, "free_bytes", lambda device, lm: (free["bytes"], "available RAM"))
    assert compile_apart.why_not(fake_lm()) is None
    assert compile_apart.why_not(fake_lm(source={})) == "not loaded by load_model"
    assert compile_apart.why_not(fake_lm(device=torch.device("cuda", 0))) == "not on CPU"
    assert compile_apart.why_not(fake_lm(adapters={"a": object()})) == "LoRA adapters loaded"
    free["bytes"] = 3 << 30  # twice the 1 GiB of weights and the margin: 3 GiB
    assert compile_apart.why_not(fake_lm()) is None
    free["bytes"] -= 1
    assert "too little RAM" in compile_apart.why_not(fake_lm())


def test_a_child_that_gets_less_than_a_quarter_core_for_twenty_seconds_counts_as_starved(monkeypatch):
    clock, cpu = {"now": 0.0}, {"s": 0.0}
    monkeypatch.setattr(compile_apart.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(compile_apart, "group_cpu_s", lambda child: cpu["s"])

    def run(share: float, seconds: float) -> bool:
        samples: list = []
        for _ in range(int(seconds * 10)):
            clock["now"] += 0.1
            cpu["s"] += 0.1 * share
            if compile_apart.starved(1, samples):
                return True
        return False

    assert not run(0.3, 60)  # slow, but going
    assert not run(0.1, 19)  # not yet judged: the window is 20 s
    assert run(0.1, 22)
    assert not run(1.0, 60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_the_cpu_time_read_is_the_childs():
    """``group_cpu_s`` reads real figures: this process's CPU time grows as it computes."""
    pid = os.getpid()
    before = compile_apart.group_cpu_s(pid)
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:
        pass
    assert compile_apart.group_cpu_s(pid) >= before + 0.2


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")
def test_the_child_runs_at_idle_priority_from_its_first_line(monkeypatch, tmp_path):
    """Set by the child after its imports (torch, transformers: 8 s of CPU), the priority came
    too late: a fresh server's first answer took 5-7 s instead of 1.6. A stand-in child (the real
    one loads a model: test_auto_compile.py) waits as an import would (long enough for a parent
    slowed by a busy machine), then reads its policy."""
    seen = tmp_path / "policy"
    code = f"import os, time; time.sleep(2); open({str(seen)!r}, 'w').write(str(os.sched_getscheduler(0)))"
    monkeypatch.setattr(compile_apart, "command", lambda spec_path: [sys.executable, "-c", code])
    monkeypatch.setattr(compile_apart, "spec_for", lambda *args: SimpleNamespace(key="no such step"))
    assert compile_apart.build(None, None, None, None, True) is False  # nothing cached by the stand-in
    assert int(seen.read_text()) == os.SCHED_IDLE
