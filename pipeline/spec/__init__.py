"""Speculative decoding: drafters propose, the target verifies in the engine's packed forward.

- ``speculative``: the settings (``Speculative``) and their checks;
- ``drafters``: n-gram prompt lookup and a draft model on its own paged cache;
- which drafts the target keeps is sampling's rule: ``pipeline.sampling.verify`` (re-exported here).
"""

from pipeline.spec.drafters import ModelDrafter, NgramDrafter
from pipeline.spec.speculative import (
    METHODS,
    Speculative,
    check_same_tokenizer,
    check_settings,
    draft_budget,
    propose,
    refuse_recurrent_draft,
)
from pipeline.sampling import verify

__all__ = [
    "ModelDrafter",
    "NgramDrafter",
    "METHODS",
    "Speculative",
    "check_same_tokenizer",
    "check_settings",
    "refuse_recurrent_draft",
    "draft_budget",
    "propose",
    "verify",
]
