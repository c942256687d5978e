"""The engine layer: many requests in flight, one model step at a time.

- ``sequence``: a request in flight (plain data and a status);
- ``scheduler``: admission, the token budget, the prefix wait, preemption (host-only);
- ``intake``: a request's front stages at admission, and the chunk each step feeds;
- ``output``: detokenisation, streaming, stop checks;
- ``handle``: the caller's side (tokens, result, cancel);
- ``engine``: the loop (``Engine.step``: intake, schedule, run, post-process, finish) and who drives it;
- ``bursts``: greedy decode steps run back to back;
- ``token_choice``: the sample phase (processors, grammar mask, sampler, log-probabilities, one read);
- ``postprocess``: a step's output into each sequence (tokens taken, drafts verified, cache keys);
- ``ends``: how a sequence leaves (finished, failed).

Imports ``pipeline.kv``, ``pipeline.sampling``, ``pipeline.runner`` and ``pipeline.spec`` (see ``[tool.importlinter]``).
"""

from pipeline.engine.engine import Engine
from pipeline.engine.handle import Cancelled, Handle
from pipeline.engine.output import Output, TextStream, holdback
from pipeline.engine.scheduler import Scheduled, Scheduler
from pipeline.engine.sequence import Drafting, Layout, Phases, Sequence, Status

__all__ = [
    "Engine",
    "Cancelled",
    "Handle",
    "Output",
    "TextStream",
    "holdback",
    "Scheduled",
    "Scheduler",
    "Drafting",
    "Layout",
    "Phases",
    "Sequence",
    "Status",
]
