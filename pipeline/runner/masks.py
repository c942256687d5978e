"""Which keys each query sees, as a range of positions in its sequence: the one rule both ways
of reading the pool (``runner.flex`` and SDPA over gathered keys) build their masks from.

``hi`` [B, L]: the first key position a query may not see (causal: its own position + 1; the
end of a bidirectional media block it lies in; the row's length). ``lo`` [B, L]: the first its
sliding window still sees, or None without a window.
"""

from __future__ import annotations

import torch


def window_start(qpos: torch.Tensor, window: int) -> torch.Tensor:
    """The first key position a query at ``qpos`` still sees through a sliding ``window``:
    transformers' rule (``masking_utils.sliding_window_overlay``) keeps key k for query q when
    k > q - window."""
    return (qpos - window + 1).clamp(min=0)


def dense_mask(keys: int, hi: torch.Tensor, lo: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, L, keys] boolean: key position k is seen by query (b, l) when lo <= k < hi."""
    position = torch.arange(keys, device=hi.device)
    mask = position < hi.unsqueeze(-1)
    if lo is not None:
        mask = mask & (position >= lo.unsqueeze(-1))
    return mask.unsqueeze(1)
