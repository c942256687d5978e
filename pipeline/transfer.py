"""Host <-> device traffic of a step, in one place: uploads that never wait, reads that are counted.

Why: on a GPU, ``torch.tensor(values, device="cuda")`` copies from pageable memory and then
waits for the stream, so every small index tensor a step builds stalls the host until the
device has drained its queue; a step that uploads six lists waits six times. Uploads here go
through pinned memory with a non-blocking copy (the copy is queued behind the work before it,
and the caching host allocator keeps the pinned buffer alive until it is done). What does have
to wait, reading the chosen tokens back or synchronising to time a step, goes through ``read``
and ``wait``, which count it: ``blocking_count()`` is what a test and the engine's metrics check
(at most one read per greedy step). On CPU the same calls run, and the count is the same.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from pipeline.metrics import synchronize

_counts = threading.local()


def upload(values: Sequence[Any], device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (nested lists of numbers) as a tensor on ``device``, without waiting for it."""
    host = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def read(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``: a blocking read on an accelerator, counted."""
    _count()
    return tensor.tolist()


def wait(device: torch.device | str | None) -> None:
    """Wait for the device's queued work (to time it), counted."""
    _count()
    synchronize(device)


def _count() -> None:
    _counts.n = getattr(_counts, "n", 0) + 1


def blocking_count() -> int:
    """Blocking transfers (reads and waits) this thread has made so far."""
    return getattr(_counts, "n", 0)
