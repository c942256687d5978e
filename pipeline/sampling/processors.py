"""The step's one hook for per-sequence logits work, vectorised over the batch.

A logits processor is any callable ``fn(logits [n, V], owners) -> logits [n, V]``: it gets the
rows of every sequence that uses it in this step, stacked, together with their owners (the
requests' Contexts), and returns them processed. A ``DecodeLoop.process_logits`` override is
one; the sampler's penalties, grammar masks and log-probabilities plug in the same way. Rows
that share a processor object (every request of one decode stage) go through one call; rows
without processors are left untouched, so their tokens stay equal to their solo runs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from pipeline.transfer import upload

LogitsProcessor = Callable[[torch.Tensor, list], torch.Tensor]


def apply_processors(
    logits: torch.Tensor, owners: Sequence[Any], processors: Sequence[Sequence[LogitsProcessor]]
) -> torch.Tensor:
    """Row i goes through ``processors[i]`` in order; each processor runs once per step on all
    its rows. Returns ``logits`` itself when no row has a processor, else a float32 copy."""
    depth = max((len(p) for p in processors), default=0)
    if depth == 0:
        return logits
    out = logits.float().clone()
    for level in range(depth):
        groups: dict[Any, tuple[LogitsProcessor, list[int]]] = {}
        for row, procs in enumerate(processors):
            if level < len(procs):
                groups.setdefault(_key(procs[level]), (procs[level], []))[1].append(row)
        for fn, rows in groups.values():
            index = upload(rows, out.device)
            processed = fn(out.index_select(0, index), [owners[r] for r in rows])
            if processed.shape != (len(rows), out.shape[1]):
                raise ValueError(
                    f"logits processor {fn!r} returned shape {tuple(processed.shape)} for "
                    f"{len(rows)} rows of {out.shape[1]} logits"
                )
            out.index_copy_(0, index, processed.to(out.dtype))
    return out


def _key(fn: LogitsProcessor) -> Any:
    """Rows share a call when their processors are equal: the same object, or the same bound
    method of the same stage (``stage.process_logits`` is a new object at every access)."""
    try:
        hash(fn)
    except TypeError:
        return id(fn)
    return fn
