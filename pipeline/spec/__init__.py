"""Speculative decoding: drafters propose, the target verifies in the engine's packed forward.

- ``speculative``: the settings (``Speculative``) and their checks;
- ``drafters``: n-gram prompt lookup and a draft model on its own paged cache;
- ``verify``: which drafts the target keeps (exact for greedy and for sampling).
"""

from pipeline.spec.drafters import ModelDrafter, NgramDrafter
from pipeline.spec.speculative import (
    METHODS,
    Speculative,
    check_same_tokenizer,
    check_settings,
    refuse_recurrent_draft,
)
from pipeline.spec.verify import draft_budget, verify

__all__ = [
    "ModelDrafter",
    "NgramDrafter",
    "METHODS",
    "Speculative",
    "check_same_tokenizer",
    "check_settings",
    "refuse_recurrent_draft",
    "draft_budget",
    "verify",
]
