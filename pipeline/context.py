"""The objects that travel through the stages: what was asked, the work in progress, the answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pipeline.kv import KVCache
from pipeline.metrics import Metrics


@dataclass
class Request:
    """What the user asks for: a conversation (or one prompt) plus media and generation settings."""

    prompt: str | None = None
    messages: list[dict] | None = None  # chat-template messages; the last one may be the user's turn
    system_prompt: str | None = None
    images: list[Any] = field(default_factory=list)  # paths or PIL images, in prompt order
    audios: list[Any] = field(default_factory=list)  # paths or (waveform, sample_rate)
    videos: list[Any] = field(default_factory=list)  # paths or pipeline.media.Video, in prompt order
    # Kinds of the prompt's media in the order given ("image", "video", "audio"), which the user
    # message follows when built from `prompt`; None: images, then videos, then audio.
    media_order: list[str] | None = None
    max_new_tokens: int = 128
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # end the answer as EOS does (with ignore_eos too)
    min_new_tokens: int = 0  # EOS, stop_token_ids and stop strings are held back until this many tokens
    priority: int = 0  # lower runs first (vLLM's convention); a waiting request preempts running ones of a higher value
    # How the chat template renders the prompt: without the reply header (add_generation_prompt
    # False), or continuing the last, assistant, message instead of starting a new turn.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    thinking: bool | None = None  # passed to the template as enable_thinking when set
    id: str | None = None
    sampler: Any = None  # this request's sampler (e.g. its own temperature and seed); None: the pipeline's
    # Per generated token, its log-probability and this many most likely alternatives (0-20;
    # None: none). "raw": the model's own distribution; "processed": after logits processors,
    # penalties, temperature and filters (pipeline.sampling.logprobs).
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    # Per prompt token from position ``prompt_logprobs_from`` on (default: all but the first),
    # its log-probability given the tokens before it and this many alternatives (0-20; None:
    # none). The positions that score are computed, never taken from the prefix cache; the
    # prefix before them may be (an evaluation's choices share their question's context).
    prompt_logprobs: int | None = None
    prompt_logprobs_from: int = 1
    # Output constraints (pipeline.runner.grammar; at most one): a JSON Schema (a dict or its
    # JSON text; {"type": "object"}: any JSON object), a regular expression, one of these
    # strings, an EBNF grammar (xgrammar's dialect), or an xgrammar structural tag (tool calls).
    json_schema: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    # OpenAI-shaped function tools the chat template renders (pipeline.structured.tools), and extra keyword
    # arguments for the template (enable_thinking comes from ``thinking``).
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    # Embed the prompt instead of answering it: prefill only, the final hidden states pooled
    # ("last": the last token's, as decoder embedders such as Qwen3-Embedding; "mean"; "cls": the
    # first token's) and L2-normalised, into ``Result.embedding``. None: generate as usual.
    pooling: str | None = None
    # The LoRA adapter to answer with, by the name it was loaded under (Pipeline.load_adapter,
    # model.lora); None: the base model.
    adapter: str | None = None


POOLINGS = ("last", "mean", "cls")


LOGPROB_FLOOR = -9999.0  # what -inf is written as: JSON has no infinities (vLLM sends the same)


def json_logprob(x: float) -> float:
    """A log-probability as JSON can carry it: -inf (a token a filter removed) and NaN to the floor."""
    return x if x == x and x > LOGPROB_FLOOR else LOGPROB_FLOOR


@dataclass
class TokenLogprob:
    """A generated token's log-probability and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first

    def to_dict(self) -> dict:
        """For result.json / results.jsonl: strict JSON (no -Infinity), the floor for -inf."""
        return {
            "token_id": self.token_id,
            "logprob": json_logprob(self.logprob),
            "top_logprobs": [[t, json_logprob(v)] for t, v in self.top],
        }


@dataclass
class Context:
    """Shared state of one inference; each stage reads what it needs and adds what it produces."""

    request: Request
    lm: Any  # pipeline.model.loading.LoadedModel
    cache: KVCache
    metrics: Metrics
    on_text: Callable[[str], None] | None = None  # streaming callback for decoded text
    input_ids: torch.Tensor | None = None  # [1, L] full prompt ids
    token_keys: list | None = None  # hashable per-position keys (media positions carry content hashes)
    model_inputs: dict = field(default_factory=dict)  # processor outputs (pixel_values, grid_thw, ...)
    inputs_embeds: torch.Tensor | None = None  # [1, L, H] when media embeddings are merged in
    logits: torch.Tensor | None = None  # [1, V] logits for the next token
    pooled: torch.Tensor | None = None  # [H] float32: Request.pooling's sum of hidden states so far
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, when asked
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # prompt position -> its score
    text: str = ""
    finish_reason: str | None = None
    extras: dict = field(default_factory=dict)  # per-family or per-stage facts worth reporting
    # Where the prompt's reply header starts (Tokenize, for models with recurrent states): the
    # next chat turn shares the prompt at least up to here, so the state there is kept.
    reply_start: int | None = None


@dataclass
class Result:
    """What a request produced, as written to result.json."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    metrics: dict
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids (Request.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, the first None
    embedding: list[float] | None = None  # Request.pooling: the prompt's L2-normalised embedding

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_ids": self.prompt_ids,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics,
            **({} if self.logprobs is None else {"logprobs": [t.to_dict() for t in self.logprobs]}),
            **(
                {}
                if self.prompt_logprobs is None
                else {"prompt_logprobs": [None if t is None else t.to_dict() for t in self.prompt_logprobs]}
            ),
            **({} if self.embedding is None else {"embedding": self.embedding}),
        }
