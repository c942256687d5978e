"""Dynamo's guards on the compiled step checked once per kind of call (``pipeline.runner.guards``):
a call like one already checked skips them, any other call (and every call while a build traces)
is checked in full, so it gets the graph its inputs need."""

from __future__ import annotations

import threading
import types

import torch

from pipeline.runner.guards import Guards, Seen


class Pool:
    """Stands for the engine's ``BlockPool`` (held weakly, as models are)."""


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 2.0  # a constant in the trace: guarded, as the engine's model attributes are


def compiled_step():
    """A compiled (model, pool, x) step, and how many times Dynamo traced it."""
    traces = []

    def backend(gm, example_inputs):
        traces.append(gm)
        return gm.forward

    def step(model, pool, x):
        return x * model.scale

    own = types.FunctionType(step.__code__.replace(), globals())  # Dynamo's cache is per code object
    return torch.compile(own, backend=backend, dynamic=False), traces


def test_a_call_like_a_checked_one_skips_the_guards_and_any_other_is_checked_in_full():
    step, traces = compiled_step()
    guards, seen, model, pool = Guards(), Seen(), Model(), Pool()
    x = torch.ones(2, 3)
    assert torch.equal(guards.call(step, seen, model, pool, (x,)), x * 2)
    model.scale = 3.0  # what a guard watches, changed: only a full check sees it
    assert torch.equal(guards.call(step, seen, model, pool, (torch.zeros(2, 3) + 1,)), x * 2)  # skipped
    assert len(traces) == 1
    # other layouts are checked in full (and traced), each once: a shape, a transposed copy, a
    # tensor made outside inference_mode after one made inside (other dispatch keys)
    assert torch.equal(guards.call(step, seen, model, pool, (torch.ones(3, 2),)), torch.full((3, 2), 3.0))
    assert torch.equal(guards.call(step, seen, model, pool, (torch.ones(3, 2).t(),)), torch.full((2, 3), 3.0))
    with torch.inference_mode():
        made_inside = torch.ones(4)
    assert torch.equal(guards.call(step, seen, model, pool, (made_inside,)), torch.full((4,), 3.0))
    assert torch.equal(guards.call(step, seen, model, pool, (torch.ones(4),)), torch.full((4,), 3.0))
    assert len(traces) == 5


def test_another_model_or_pool_is_checked_in_full():
    step, traces = compiled_step()
    guards, seen, pool = Guards(), Seen(), Pool()
    first, second = Model(), Model()
    second.scale = 5.0
    x = torch.ones(2)
    guards.call(step, seen, first, pool, (x,))
    assert torch.equal(guards.call(step, seen, second, pool, (x,)), torch.full((2,), 5.0))
    second.scale = 7.0
    assert torch.equal(guards.call(step, seen, second, Pool(), (x,)), torch.full((2,), 7.0))


def test_no_call_skips_guards_while_another_checks_them_in_full():
    """``set_stance`` is process-wide: while a build traces (``checking``), on this thread or
    another, every call is checked in full."""
    step, traces = compiled_step()
    guards, seen, model, pool = Guards(), Seen(), Model(), Pool()
    x = torch.ones(2)
    guards.call(step, seen, model, pool, (x,))
    model.scale = 4.0
    with guards.checking():
        assert torch.equal(guards.call(step, seen, model, pool, (x,)), torch.full((2,), 4.0))
    entered, leave = threading.Event(), threading.Event()

    def build() -> None:
        with guards.checking():
            entered.set()
            leave.wait(10)

    builder = threading.Thread(target=build)
    builder.start()
    entered.wait(10)
    model.scale = 6.0
    assert torch.equal(guards.call(step, seen, model, pool, (x,)), torch.full((2,), 6.0))
    leave.set()
    builder.join()
    # skipping again: where the guards left (those telling cached graphs apart) fail, the call is
    # checked in full, not failed; where none are left, a change goes unseen
    model.scale = 8.0
    assert torch.equal(guards.call(step, seen, model, pool, (x,)), torch.full((2,), 8.0))
    other, _ = compiled_step()
    guards.call(other, seen, model, pool, (x,))
    model.scale = 9.0
    assert torch.equal(guards.call(other, seen, model, pool, (x,)), torch.full((2,), 8.0))
