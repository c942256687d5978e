"""Where a token is chosen from logits: the one home of sampling.

- ``sampler``: ``Sampler`` (``stages.Sampler``): greedy, or transformers' filters op for op
  (repetition penalty, temperature, top-k, top-p, min-p) and a draw with no host sync;
- ``processors``: per-sequence logits processors (``DecodeLoop.process_logits``), batched;
- ``choose``: one token per row of a step: argmax rows together, batchable samplers together,
  any other sampler on its own row;
- ``logprobs``: the chosen tokens' log-probabilities and top alternatives, read with them;
- ``verify``: speculative decoding's rule for which drafts the target keeps (exact).

The engine's "sample" phase (``pipeline.engine.token_choice``) calls these after each forward.
Depends on nothing of the project but the leaf modules ``errors`` and ``transfer``.
"""

from pipeline.sampling import logprobs
from pipeline.sampling.choose import argmax, argmax_only, choose, fork_sampler
from pipeline.sampling.processors import LogitsProcessor, apply_processors
from pipeline.sampling.sampler import Sampler
from pipeline.sampling.verify import verify

__all__ = [
    "LogitsProcessor",
    "Sampler",
    "apply_processors",
    "argmax",
    "argmax_only",
    "choose",
    "fork_sampler",
    "logprobs",
    "verify",
]
