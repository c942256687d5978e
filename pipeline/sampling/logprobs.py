"""Log-probabilities of the chosen tokens and their top alternatives, read with the step's tokens.

By default (``raw``) the model's own distribution: log-softmax of its logits before logits
processors, penalties and temperature (vLLM's default, and what evaluation scores). ``processed``:
the distribution the token was chosen from, after them (tokens a filter removed are -inf).
Computed on the device for the rows that ask, packed with the chosen ids into one tensor, so
asking costs no extra wait for the device.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from pipeline.errors import UserError

MAX_LOGPROBS = 20  # top alternatives a request may ask for (OpenAI's top_logprobs limit)
MODES = ("raw", "processed")


def check_setting(name: str, value: Any) -> None:
    """The rule for ``logprobs`` / ``prompt_logprobs`` (None: none asked) and ``logprobs_mode``
    (``name`` may carry a prefix: ``batch.logprobs``)."""
    if name.rpartition(".")[2] == "logprobs_mode":
        if value not in MODES:
            raise UserError(f"{name} must be one of {', '.join(MODES)} (got {value!r})")
    elif value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS
    ):
        raise UserError(f"{name} must be a whole number from 0 to {MAX_LOGPROBS} (got {value!r})")


def processed_scores(
    logits: torch.Tensor,
    samplers: Sequence[Any],
    history: Callable[[int], Sequence[int]],
    outputs: Callable[[int], Sequence[int]],
) -> torch.Tensor:
    """Each row of ``logits`` (after the logits processors) through its sampler's own filters:
    what ``Sampler.filtered_logits`` leaves (a sampler without it, or none: the row as it is)."""
    rows = []
    for i, sampler in enumerate(samplers):
        row = logits[i : i + 1].float()
        filtered = getattr(sampler, "filtered_logits", None)
        rows.append(filtered(row, [list(history(i))], [list(outputs(i))]) if filtered is not None else row)
    return torch.cat(rows)


def table(scores: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """[w, 1 + 2k] float64 for ``scores`` [w, V] (logits) and ``chosen`` [w]: each row's chosen
    token's log-probability, its top ``k`` log-probabilities, then their token ids."""
    logprobs = torch.log_softmax(scores.float(), dim=-1)
    parts = [logprobs.gather(1, chosen.reshape(-1, 1))]
    if k:
        top = logprobs.topk(k, dim=-1)
        parts += [top.values, top.indices]
    return torch.cat([p.double() for p in parts], dim=1)


def unpack(row: Sequence[float], k: int, want: int) -> tuple[float, list[tuple[int, float]]]:
    """One row of ``table`` read back: (the chosen token's log-probability, its ``want`` best
    alternatives as (token id, log-probability), most likely first)."""
    return row[0], [(int(row[1 + k + j]), row[1 + j]) for j in range(want)]
