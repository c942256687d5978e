"""Dynamo's guards on the compiled decode step: checked in full once per kind of call, not per call.

Before every call of a compiled function Dynamo checks its guards: each input's shape, strides
and dtype, and every attribute of the model the trace read (each layer's modules, their
forwards, the routed norms' and kernels' tables). For a 10-layer Llama that was about 11,000
guard nodes, 200 of them Python lambdas: the check alone 0.43 ms, and a 254M model's int8 decode
step 0.9 ms faster without it (measured, 2-core EPYC: 7% of the step; more of a small model's).
About 4,200 and 60 since the kernel's wrappers became their layers' class (``matvec.attach``).
Inside the engine nothing they watch changes between steps but the inputs, so (as vLLM's
compiled models skip Dynamo's dispatch once warm) a call whose inputs look exactly like those of
an earlier call that passed the full check (same shapes, strides, dtypes and devices, the same
model, pool and modes) runs under ``skip_guard_eval_unsafe``: only the guards that tell the
cached graphs apart are checked, which picks the graph the full check picked (where none fits
by those, Dynamo raises before running any, and the call is checked in full). A call of any
other kind is checked in full (and compiles if no graph fits), then joins the known ones.

``set_stance`` is process-wide, so no call may look for its graph while another thread's call
skips guards (a build beside an engine, another pipeline's step): a call that skips them holds
one lock throughout, and while any call or build checks them in full, none skips them.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch

from pipeline.runner import matvec


# What Dynamo raises where a call that skips guards fits none of the graphs by those it checks
SKIP_FAILED = "Recompilation triggered with skip_guard_eval_unsafe"


class Guards:
    """Which kinds of call passed Dynamo's full guard check, and the process-wide switch to skip
    it (one per process: ``GUARDS``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held through a call that skips guards, and to count the others
        self._checking = 0  # calls and builds checking guards in full now: no call skips them meanwhile

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """Around a call or build whose guards are checked in full: no call skips them meanwhile
        (one that does is waited for: a step's milliseconds)."""
        with self._lock:
            self._checking += 1
        try:
            yield
        finally:
            with self._lock:
                self._checking -= 1

    def call(self, compiled: Any, seen: Seen, model: Any, pool: Any, inputs: tuple[torch.Tensor, ...]) -> Any:
        """``compiled(model, pool, *inputs)``, skipping the guards where a call like it passed them
        (``seen``: the calls of this compiled function that did)."""
        known = seen.of(model, pool)
        signature = _signature(inputs)
        if signature in known:
            with self._lock:
                if not self._checking:
                    try:
                        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                            return compiled(model, pool, *inputs)
                    except RuntimeError as err:  # no graph passed the guards left: raised before any ran
                        if SKIP_FAILED not in str(err):
                            raise
        with self.checking():
            out = compiled(model, pool, *inputs)
        known.add(signature)
        return out


GUARDS = Guards()


class Seen:
    """The signatures of the calls that passed the full check, per model and pool (held weakly:
    a model or pool freed takes its signatures along, so a new one at its address starts over)."""

    def __init__(self) -> None:
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def of(self, model: Any, pool: Any) -> set:
        pools = self._models.get(model)
        if pools is None:
            pools = self._models[model] = weakref.WeakKeyDictionary()
        known = pools.get(pool)
        if known is None:
            known = pools[pool] = set()
        return known


def _signature(inputs: tuple[torch.Tensor, ...]) -> tuple:
    """What a call's guards check that can differ between the engine's calls on one model and
    pool: what Dynamo's tensor checks read of its inputs (their layout, and whether each was made
    under ``inference_mode``: its dispatch keys) and the modes the trace read."""
    modes = (
        matvec.enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_grad_enabled(),
        torch.get_num_threads(),
        torch.get_default_dtype(),
    )
    return (
        modes,
        *((type(t), t.shape, t.stride(), t.dtype, t.device, t.is_inference(), t.requires_grad) for t in inputs),
    )
