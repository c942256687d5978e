"""The OpenAI request shapes this server accepts, checked by pydantic, and what they become:
our ``Request`` (messages with media placeholders, images, videos and audio in prompt order, sampler);
the server's settings (``ServeSettings``), one HTTP request's sequences (``Call``) and its errors
(``APIError``, answered as OpenAI does).

A top-level field the server does not implement is refused with a 400 that names it
(``unsupported``), except a few that change nothing about the answer (``HARMLESS``); inside
messages and parts, unknown fields are ignored. Known fields of the wrong type are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pipeline.context import Request
from pipeline.serve.answer import Reading
from pipeline.serve.media import MediaPolicy


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ImageURL(_Open):
    url: str
    detail: str | None = None


class ImagePart(_Open):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Open):
    url: str


class VideoPart(_Open):
    """vLLM's extension for video: ``{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}``."""

    type: Literal["video_url"]
    video_url: VideoURL


class AudioData(_Open):
    data: str  # base64, no data: prefix (OpenAI's input_audio)
    format: str | None = None


class AudioPart(_Open):
    type: Literal["input_audio"]
    input_audio: AudioData


class AudioURL(_Open):
    url: str


class AudioURLPart(_Open):
    """vLLM's extension for audio by URL: ``{"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..."}}``
    (the URL rules of ``image_url``)."""

    type: Literal["audio_url"]
    audio_url: AudioURL


Part = Annotated[Union[TextPart, ImagePart, VideoPart, AudioPart, AudioURLPart], Field(discriminator="type")]


class FunctionCall(_Open):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Part], None] = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class StreamOptions(_Open):
    include_usage: bool = False


# Accepted and ignored: bookkeeping for the client's side, no effect on the answer.
HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})


class Body(_Open):
    """A request body of any endpoint: ``model`` (the id the client asks for) and, kept aside,
    the top-level fields it does not declare, to be refused by name (``unsupported``)."""

    model: str | None = None

    def unsupported(self) -> list[str]:
        """Top-level fields this server does not implement (``HARMLESS`` ones aside)."""
        return sorted(set(self.model_extra or {}) - HARMLESS)


class Sampling(Body):
    """Fields shared by chat and text completions (vLLM's extensions included: top_k, min_p,
    repetition_penalty, ignore_eos)."""

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0, lt=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    stop_token_ids: list[int] | None = None  # vLLM's: token ids that end the answer (kept in it)
    min_tokens: int = Field(default=0, ge=0)  # vLLM's: EOS, stop ids and stop strings held back until then
    priority: int = 0  # vLLM's: lower runs first; preempts running requests of a higher value
    response_format: dict[str, Any] | None = None  # OpenAI's text | json_object | json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's json | regex | choice | grammar

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class ChatCompletionRequest(Sampling):
    messages: list[Message]
    add_generation_prompt: bool = True  # vLLM's: false renders no reply header
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued, not a new turn
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(Sampling):
    """The legacy completions: one prompt or several (text, or token ids), ``echo`` and ``logprobs``
    (``max_tokens: 0`` with ``echo`` scores the prompt only)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class TokenizeRequest(_Open):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Open):
    model: str | None = None
    tokens: list[int]


FINISH = {"eos": "stop", "stop": "stop", "length": "length", None: "stop"}
# Arguments the server itself gives apply_chat_template: not for chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "tools",
        "conversation",
        "messages",
    }
)


@dataclass
class ServeSettings:
    """What ``serve.*`` configures (checked in ``pipeline.modes.serve``)."""

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 32 << 20
    max_tokens: int = 8192  # cap on a request's max_tokens
    default_max_tokens: int = 1024  # when a request gives none
    max_n: int = 8
    media: MediaPolicy = field(default_factory=MediaPolicy)
    pooling: str = "last"  # /v1/embeddings (Request.pooling)
    max_waiting: int | None = 256  # requests waiting for the engine beyond this: 503 (None: no bound)
    cors_origins: list[str] = field(default_factory=list)  # browser origins allowed (CORS); "*": any
    max_stored_responses: int = 1000  # /v1/responses kept for previous_response_id (LRU)
    runtime_lora: bool = True  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer (False: 404)


@dataclass
class Call:
    """One HTTP request's sequences, in response order: ``n`` choices for each prompt. ``ids``:
    each one's raw prompt ids (completions; None for chat), ``prompts``: the text ``echo`` returns,
    ``top``: alternatives per token when log-probabilities are asked (None: not asked)."""

    requests: list[Request]
    ids: list[list[int] | None]
    prompts: list[str]
    n: int = 1
    echo: bool = False
    top: int | None = None
    reading: Reading = field(default_factory=Reading)  # how to read the answers (tools, reasoning)
    model: str = ""  # the name its answers carry: the model the client asked for (base or adapter)


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "code"}}`` (``headers``:
    sent with it, e.g. ``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "code": code}}, status_code=status, headers=headers
    )
