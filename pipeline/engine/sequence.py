"""A request in flight: plain data and a status, read and written by the engine's parts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"  # admitted: scheduled at every step until it ends
    FINISHED = "finished"  # ended (done, failed or cancelled); its handle has the outcome


@dataclass
class Phases:
    """What a request runs besides the model: its per-request stages (``front`` at admission,
    ``after`` once done), the engine-phase stages whose hooks the engine calls (``prefill``:
    ``plan_chunk``; ``decode``: ``on_token``), the logits ``processors`` its rows go through each
    step, and ``finalize``, which turns the finished Context into what the handle returns."""

    front: Mapping[str, Callable] = field(default_factory=dict)
    after: Mapping[str, Callable] = field(default_factory=dict)
    prefill: Any = None
    decode: Any = None
    finalize: Callable | None = None
    processors: list = field(default_factory=list)  # logits processors (pipeline.sampling.processors), in order


@dataclass
class Layout:
    """The prompt's positions, known once its front stages ran: ``rows`` [position rows][prompt],
    ``offsets`` [position rows] (generated token p has positions ``offsets + p``), ``spans``:
    prompt spans attended both ways (a chunk never ends inside one)."""

    rows: list[list[int]]
    offsets: list[int]
    spans: list[tuple[int, int]]


@dataclass
class Drafting:
    """Speculative decoding state: the drafter, drafts asked per round, this step's drafts and
    their draft distributions (None: point masses)."""

    drafter: Any
    per_round: int
    drafts: list[int] = field(default_factory=list)
    q: Any = None


@dataclass(eq=False)
class Sequence:
    """One request's state in the engine.

    ``prefill_only``: stop after the prompt, leaving ``ctx.logits`` (scoring, the Prefill stage
    by hand). ``release``: return the cache's blocks when done (the caller keeps no handle on
    it). ``pending``: prefill logits handed over by a hand-driven Prefill, sampled first.
    """

    ctx: Any  # pipeline.context.Context
    sampler: Any = None  # None: argmax
    phases: Phases = field(default_factory=Phases)
    prefill_only: bool = False
    release: bool = False
    spec: Drafting | None = None
    handle: Any = None  # pipeline.engine.handle.Handle
    status: Status = Status.WAITING
    prompt_len: int = 0
    ids: list[int] = field(default_factory=list)  # prompt + generated token ids
    keys: list = field(default_factory=list)  # their cache keys (media positions carry content hashes)
    layout: Layout | None = None  # set at admission (``prepared``)
    output: Any = None  # pipeline.engine.output.Output, for sequences that generate
    pending: Any = None
    cancelled: bool = False
    grammar: Any = None  # pipeline.runner.grammar.Matcher: the output constraint, if any
    started: bool = False  # admitted at least once (queue_s recorded)
    adapter: Any = None  # the request's LoRA adapter (pipeline.model.lora.Adapter; None: the base model)

    @property
    def cache(self) -> Any:
        return self.ctx.cache

    @property
    def prepared(self) -> bool:
        return self.layout is not None

    @property
    def known(self) -> int:
        """Prompt + generated tokens; the cache holds all but the last generated one while decoding."""
        return len(self.ids)

    @property
    def done(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def priority(self) -> int:
        """``Request.priority``: lower runs first."""
        return int(getattr(getattr(self.ctx, "request", None), "priority", 0) or 0)

    @property
    def scores_prompt(self) -> bool:
        """``Request.prompt_logprobs``: the positions before the scored prompt tokens are computed
        (none taken from a cache) and their logits rows kept, each to score the token after it."""
        return getattr(getattr(self.ctx, "request", None), "prompt_logprobs", None) is not None

    @property
    def scored_from(self) -> int:
        """The first prompt position scored (``Request.prompt_logprobs_from``)."""
        return self.ctx.request.prompt_logprobs_from

    def reusable(self, keys: list) -> list:
        """The keys a cache may keep a prefix of: all, or (scoring the prompt from position s)
        the first s, of which a cache keeps at most s - 1: the row scoring position s is computed;
        none for an embedding pooled from every row (``Request.pooling`` "mean" or "cls")."""
        if getattr(getattr(self.ctx, "request", None), "pooling", None) in ("mean", "cls"):
            return []
        return keys[: self.scored_from] if self.scores_prompt else keys

    @property
    def drafts(self) -> list[int]:
        return self.spec.drafts if self.spec is not None else []
