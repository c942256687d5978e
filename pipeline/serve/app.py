"""The OpenAI-compatible HTTP API over one pipeline (``create_app``), built with FastAPI.

Every request becomes one engine sequence per choice. The loop never touches the device: another
thread drives the engine (``Engine.drive``; ``mode=serve`` drives it on the main thread while
uvicorn serves on its own), and media decoding and submission (which may upload ids to the
device) run on worker threads, so the loop never waits on the model. A streamed response is
committed (status 200) only once its first piece of text or its end is known, so a request that
fails before generating anything (bad media, a prompt too long) still gets its 4xx JSON error. A
client that goes away cancels its sequences:
their blocks go back to the pool at the next engine step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import traceback
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from pipeline.context import Request, Result
from pipeline.engine import Cancelled, Handle
from pipeline.errors import UserError
from pipeline.memory import text_config
from pipeline.pipeline import Pipeline
from pipeline.structured.response_format import from_response_format, from_structured_outputs
from pipeline.runner.grammar import inside_think, think_ids
from pipeline.serve.answer import Deltas, Reading, message
from pipeline.serve.bridge import Submission
from pipeline.serve.media import MediaPolicy, audio_from_base64, image_from_url, video_from_url
from pipeline.serve.prometheus import ServerMetrics
from pipeline.serve import logprobs as lp
from pipeline.serve.protocol import (
    FINISH,
    RESERVED_TEMPLATE_KWARGS,
    AudioPart,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ImagePart,
    Sampling,
    TextPart,
    TokenizeRequest,
    VideoPart,
)
from pipeline.structured.tools import call_grammar, check_tools, tool_format
from stages.sampler import Sampler

PAGE = Path(__file__).parent / "static" / "chat.html"


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


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


def error_response(
    status: int, message: str, type_: str = "invalid_request_error", code: str | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": code}}, status_code=status)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class BodyLimit:
    """ASGI middleware: request bodies over ``limit`` bytes get 413 (declared or streamed)."""

    class _TooLarge(Exception):
        pass

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        seen = 0
        started = False

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyLimit._TooLarge
            return message

        async def watched(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyLimit._TooLarge:
            if not started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope: dict, receive: Callable, send: Callable) -> None:
        message = f"request body over serve.max_body_bytes ({self.limit} bytes)"
        await error_response(413, message, code="body_too_large")(scope, receive, send)


def create_app(
    pipe: Pipeline,
    settings: ServeSettings,
    draining: Callable[[], bool] = lambda: False,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """The FastAPI app serving ``pipe``. Some other thread must drive its engine while it serves,
    e.g. ``pipe.engine.drive(stopped.is_set)`` (``mode=serve`` drives it on the main thread)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="mm-pipeline", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    api = _API(pipe, settings, draining)
    app.state.api = api

    @app.exception_handler(APIError)
    async def _api_error(_: HTTPRequest, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.type, err.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HTTPRequest, err: RequestValidationError) -> JSONResponse:
        problems = err.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return error_response(400, "the request body is not valid JSON", code="invalid_json")
        first = problems[0] if problems else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
        return error_response(400, f"{where}: {first.get('msg', 'invalid value')}", code="invalid_value")

    @app.exception_handler(HTTPException)
    async def _http(_: HTTPRequest, err: HTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail), code="not_found" if err.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def _crash(_: HTTPRequest, err: Exception) -> JSONResponse:
        traceback.print_exception(err, file=sys.stderr)
        return error_response(500, f"internal error ({type(err).__name__})", "server_error")

    def authorized(http: HTTPRequest) -> None:
        if settings.api_key is None:
            return
        given = http.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(
                401, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error", "invalid_api_key"
            )

    @app.get("/health")
    async def health() -> JSONResponse:
        if draining():
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(api.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": settings.model_name, "object": "model", "created": api.started, "owned_by": "mm-pipeline"}
                ],
            }
        )

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(api.tokenize, body))

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(api.detokenize, body))

    @app.get("/tokenizer_info", dependencies=[Depends(authorized)])
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(api.tokenizer_info())

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatCompletionRequest, http: HTTPRequest) -> Response:
        return await api.complete(body, http, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, http: HTTPRequest) -> Response:
        return await api.complete(body, http, chat=False)

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app


class _API:
    """The completion endpoints' logic: requests in, engine sequences, OpenAI responses out."""

    def __init__(self, pipe: Pipeline, settings: ServeSettings, draining: Callable[[], bool]) -> None:
        self.pipe, self.settings, self.draining = pipe, settings, draining
        self.metrics = ServerMetrics(pipe.engine)
        self.started = int(time.time())
        self.texts = lp.TokenTexts(pipe.lm.tokenizer)
        self.think_ids = think_ids(pipe.lm.tokenizer)
        self._scorer: Pipeline | None = None  # prefill only: completions with max_tokens 0 (echo)

    @property
    def scorer(self) -> Pipeline:
        """The chain without its decode stage, on the same engine: prompts scored, nothing generated."""
        if self._scorer is None:
            self._scorer = self.pipe.with_stages({k: v for k, v in self.pipe.stages.items() if k != "decode"})
        return self._scorer

    # --- requests in ------------------------------------------------------------------------
    def _check(self, body: Sampling, max_tokens: int | None) -> int:
        s = self.settings
        if self.draining():
            raise APIError(503, "the server is shutting down", "unavailable", "draining")
        unsupported = body.unsupported()
        if unsupported:
            raise APIError(
                400,
                f"{', '.join(unsupported)}: not supported by this server (docs/serve.md lists the "
                f"fields it implements)",
                code="unsupported_parameter",
            )
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", code="invalid_value")
        if isinstance(body, CompletionRequest) and max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens=0 returns nothing without echo: true", code="invalid_value")
        if isinstance(body, CompletionRequest) and body.echo and body.stream:
            raise APIError(400, "echo with stream is not supported: ask without stream", code="invalid_value")
        if body.model and body.model != s.model_name:
            raise APIError(
                404, f"model {body.model!r} not found: this server serves {s.model_name!r}", code="model_not_found"
            )
        if body.n > s.max_n:
            raise APIError(400, f"n={body.n} is over serve.max_n ({s.max_n})", code="invalid_value")
        tokens = max_tokens if max_tokens is not None else s.default_max_tokens
        if tokens > s.max_tokens:
            raise APIError(400, f"max_tokens={tokens} is over serve.max_tokens ({s.max_tokens})", code="invalid_value")
        return tokens

    def _sampler(self, body: Sampling, choice: int) -> Any:
        """The server's sampler settings, overridden by the request's temperature / top_p / seed
        (choice ``i`` of ``n`` seeded with seed + i, so the choices differ and each reproduces)."""
        base = getattr(self.pipe.stages.get("decode"), "sampler", None)
        names = (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "seed",
        )
        settings = {k: getattr(base, k) for k in names} if isinstance(base, Sampler) else {}
        for name in names:
            value = getattr(body, name)
            if value is not None:
                settings[name] = max(value, 0) if name == "top_k" else value  # vLLM's -1: off
        if settings.get("seed") is not None:
            settings["seed"] += choice
        try:
            return Sampler(**settings)
        except ValueError as err:
            raise APIError(400, str(err), code="invalid_value") from None

    def _messages(self, body: ChatCompletionRequest) -> tuple[list[dict], list, list, list]:
        """OpenAI messages -> chat-template messages with media placeholders, images, audios, videos."""
        lm, policy = self.pipe.lm, self.settings.media
        if not body.messages:
            raise UserError("messages is empty")
        family = lm.family
        messages: list[dict] = []
        images: list = []
        audios: list = []
        videos: list = []
        for m, msg in enumerate(body.messages):
            role = "system" if msg.role == "developer" else msg.role
            content = msg.content or ""
            calls = {"tool_calls": [c.model_dump(exclude_none=True) for c in msg.tool_calls]} if msg.tool_calls else {}
            if msg.role == "tool":
                calls = {"tool_call_id": msg.tool_call_id or ""}
            if isinstance(content, str):
                if role == "user" and family.media:
                    content = family.content(content, 0, 0)  # as mode=run renders a text prompt
                messages.append({"role": role, "content": content, **calls})
                continue
            parts: list[dict] = []
            for p, part in enumerate(content):
                where = f"messages[{m}].content[{p}]"
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": part.text})
                    continue
                kind = "image" if isinstance(part, ImagePart) else "video" if isinstance(part, VideoPart) else "audio"
                if kind not in family.media:
                    article = "an" if kind[0] in "aeiou" else "a"
                    raise UserError(f"{where}: {lm.path} is a {family.name} model without {article} {kind} encoder")
                if isinstance(part, ImagePart):
                    if len(images) >= policy.max_images:
                        raise UserError(f"{where}: more than serve.max_images ({policy.max_images}) images")
                    images.append(image_from_url(part.image_url.url, where, policy))
                    parts.append({"type": "image"})
                elif isinstance(part, VideoPart):
                    if len(videos) >= policy.max_videos:
                        raise UserError(f"{where}: more than serve.max_videos ({policy.max_videos}) videos")
                    videos.append(video_from_url(part.video_url.url, where, policy))
                    parts.append({"type": "video"})
                elif isinstance(part, AudioPart):
                    if len(audios) >= policy.max_audios:
                        raise UserError(f"{where}: more than serve.max_audios ({policy.max_audios}) audio clips")
                    rate = family.audio_rate(lm)
                    audios.append(audio_from_base64(part.input_audio.data, where, rate, policy))
                    parts.append({"type": "audio", "audio": f"audio {len(audios)}"})
            if not family.media:  # text models' templates take a string
                content = "".join(part["text"] for part in parts)
            else:
                content = parts
            messages.append({"role": role, "content": content, **calls})
        return messages, images, audios, videos

    def _requests(self, body: Sampling, chat: bool, tokens: int) -> Call:
        """One Request per choice of each prompt (completions: with its raw prompt ids). Runs off
        the loop: media decoding and tokenizing are CPU work."""
        common = dict(max_new_tokens=tokens, ignore_eos=body.ignore_eos, stop=body.stops())
        if chat:
            assert isinstance(body, ChatCompletionRequest)
            messages, images, audios, videos = self._messages(body)
            kwargs = dict(body.chat_template_kwargs or {})
            reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
            if reserved:
                raise UserError(f"chat_template_kwargs: {reserved[0]!r} is set by the server (tools go in tools)")
            thinking = kwargs.pop("enable_thinking", None)
            reading, constraint = self._tools(body)
            common.update(
                messages=messages,
                images=images,
                audios=audios,
                videos=videos,
                chat_template_kwargs=kwargs or None,
                thinking=None if thinking is None else bool(thinking),
                tools=body.tools,
                **constraint,
            )
            top = (body.top_logprobs or 0) if body.logprobs else None
            requests = [Request(**common, sampler=self._sampler(body, i), logprobs=top) for i in range(body.n)]
            return Call(requests, [None] * body.n, [""] * body.n, body.n, top=top, reading=reading)
        assert isinstance(body, CompletionRequest)
        common.update(self._constraint(body))
        prompts = self._prompts(body.prompt)
        top, echo = body.logprobs, body.echo
        call = Call([], [], [], body.n, echo, top)
        for ids, text in prompts:
            for i in range(body.n):
                call.requests.append(
                    Request(
                        **common, sampler=self._sampler(body, i), logprobs=top, prompt_logprobs=top if echo else None
                    )
                )
                call.ids.append(ids)
                call.prompts.append(text)
        return call

    @staticmethod
    def _constraint(body: Sampling) -> dict:
        """``response_format`` or ``structured_outputs`` as Request fields (one of them)."""
        if body.response_format is not None and body.structured_outputs is not None:
            raise UserError("give response_format or structured_outputs, not both")
        if body.response_format is not None:
            return from_response_format(body.response_format)
        if body.structured_outputs is not None:
            return from_structured_outputs(body.structured_outputs)
        return {}

    def _tools(self, body: ChatCompletionRequest) -> tuple[Reading, dict]:
        """How to read the answers, and the request's constraint: its response format, or with
        ``tool_choice`` required or a named function, the call's grammar."""
        constraint = self._constraint(body)
        reading = Reading(thinks=self.think_ids is not None)
        if body.tools is None:
            if body.tool_choice is not None:
                raise UserError("tool_choice needs tools")
            return reading, constraint
        tools, choice = check_tools(body.tools, body.tool_choice)
        lm = self.pipe.lm
        template = getattr(lm.template_owner, "chat_template", None)
        reading.fmt = None if choice == "none" else tool_format(template, lm.tokenizer.get_vocab())
        reading.params = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        tag = None if reading.fmt is None else call_grammar(reading.fmt, tools, choice, body.parallel_tool_calls)
        if tag is not None:
            if constraint:
                raise UserError(
                    "tool_choice required or a named function already constrains the answer: "
                    "leave out response_format / structured_outputs"
                )
            constraint = {"structural_tag": tag}
        return reading, constraint

    def _opened(self, ids: Any) -> bool:
        """The prompt ends inside an open think block (the template began the reasoning)."""
        if self.think_ids is None or ids is None:
            return False
        return inside_think(ids.reshape(-1).tolist() if hasattr(ids, "reshape") else list(ids), *self.think_ids)

    def _prompts(self, prompt: Any) -> list[tuple[list[int], str]]:
        """A completions ``prompt`` (a string, token ids, or a list of either) as (ids, text) pairs."""
        tokenizer = self.pipe.lm.tokenizer
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise UserError("prompt is empty")
        vocab = len(tokenizer)
        out = []
        for k, p in enumerate(prompt):
            where = "prompt" if len(prompt) == 1 else f"prompt[{k}]"
            if not p:
                raise UserError(f"{where} is empty")
            if isinstance(p, str):
                out.append((tokenizer(p)["input_ids"], p))
                continue
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise UserError(f"{where}: token ids {bad[:5]} are outside the vocabulary of {vocab} tokens")
            out.append((list(p), tokenizer.decode(p)))
        return out

    # --- tokenizer endpoints (vLLM's shapes: lm-eval's remote tokenizer uses them) ----------------
    def tokenize(self, body: TokenizeRequest) -> dict:
        tokenizer = self.pipe.lm.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", code="invalid_value")
        if body.messages is not None:
            messages = [
                {
                    "role": m.role,
                    "content": m.content
                    if isinstance(m.content, str)
                    else "".join(p.text for p in m.content or [] if isinstance(p, TextPart)),
                }
                for m in body.messages
            ]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.add_generation_prompt
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self._context(), "tokens": ids, "token_strs": strs}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        tokenizer = self.pipe.lm.tokenizer
        bad = [t for t in body.tokens if not 0 <= t < len(tokenizer)]
        if bad:
            raise APIError(
                400,
                f"tokens: ids {bad[:5]} are outside the vocabulary of {len(tokenizer)} tokens",
                code="invalid_value",
            )
        return {"prompt": tokenizer.decode(body.tokens)}

    def tokenizer_info(self) -> dict:
        tokenizer = self.pipe.lm.tokenizer
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": self._context(),
            "vocab_size": len(tokenizer),
        }

    def _context(self) -> int | None:
        """The model's context length, as the engine's limit check reads it."""
        return getattr(text_config(self.pipe.lm.config), "max_position_embeddings", None)

    # --- responses out ----------------------------------------------------------------------
    async def complete(self, body: Sampling, http: HTTPRequest, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        try:
            tokens = self._check(body, max_tokens)
            call = await asyncio.to_thread(self._requests, body, chat, tokens)
        except UserError as err:
            return self._failed(rid, endpoint, APIError(400, str(err), code="invalid_value"))
        except APIError as err:
            return self._failed(rid, endpoint, err)
        sub = Submission()
        try:
            await asyncio.to_thread(self._submit, sub, rid, call, body.stream)
        except UserError as err:  # refused at submission (a bad output constraint): nothing else runs
            sub.cancel()
            return self._failed(rid, endpoint, APIError(400, str(err), code="invalid_value"))
        meta = {"id": rid, "created": int(time.time()), "model": self.settings.model_name}
        if body.stream:
            return await self._stream(body, http, sub, meta, chat, endpoint, call)
        return await self._whole(http, sub, meta, chat, endpoint, call)

    def _submit(self, sub: Submission, rid: str, call: Call, stream: bool) -> None:
        """Queue the choices on the engine (a prompt scored with max_tokens 0 on the prefill-only
        chain). Run off the event loop: a submission may touch the device (raw ids uploaded to
        it, a draft model's pool made on first use), which would stall every open stream for as
        long as the device is busy."""
        for i, (request, ids) in enumerate(zip(call.requests, call.ids)):
            request.id = f"{rid}-{i}"
            pipe = self.scorer if request.max_new_tokens == 0 else self.pipe
            sub.track(pipe.submit(request, on_text=sub.on_text(i) if stream else None, ids=ids))

    def _failed(self, rid: str, endpoint: str, err: APIError) -> JSONResponse:
        self.metrics.requests.labels(endpoint, str(err.status)).inc()
        log(f"{rid} {err.status} {err.message}")
        return error_response(err.status, err.message, err.type, err.code)

    def _outcome(self, handles: list[Handle]) -> tuple[list[Result] | None, APIError | None]:
        """The finished handles' results, or the API error their first failure maps to."""
        try:
            return [handle.result() for handle in handles], None
        except UserError as err:
            return None, APIError(400, str(err), code="invalid_value")
        except Cancelled:
            return None, APIError(499, "cancelled", "cancelled")
        except Exception as err:  # a failed forward: reported, never a traceback to the client
            traceback.print_exception(err, file=sys.stderr)
            return None, APIError(500, f"internal error ({type(err).__name__}: {err})", "server_error")

    def _done(self, rid: str, endpoint: str, results: list[Result]) -> None:
        for result in results:
            self.metrics.finished(result.metrics)
        self.metrics.requests.labels(endpoint, "200").inc()
        m = results[0].metrics
        log(
            f"{rid} 200 prompt={m.get('prompt_tokens')} generated={sum(len(r.token_ids) for r in results)} "
            f"ttft={m.get('ttft_s') or 0:.3f}s reused={m.get('kv_reused_tokens')}"
        )

    @staticmethod
    def _usage(results: list[Result], n: int) -> dict:
        """Each prompt counted once (its ``n`` choices share it); ``cached_tokens``: its tokens the
        prefix cache held."""
        firsts = results[::n]
        prompt = sum(r.prompt_tokens for r in firsts)
        completion = sum(len(r.token_ids) for r in results)
        cached = sum(int(r.metrics.get("kv_reused_tokens") or 0) for r in firsts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    @staticmethod
    def _metrics(result: Result) -> dict:
        keys = (
            "ttft_s",
            "tpot_s",
            "decode_tok_s",
            "prefill_tok_s",
            "queue_s",
            "prompt_tokens",
            "kv_reused_tokens",
            "prefill_tokens",
            "generated_tokens",
            "total_s",
        )
        return {k: result.metrics.get(k) for k in keys}

    async def _whole(
        self, http: HTTPRequest, sub: Submission, meta: dict, chat: bool, endpoint: str, call: Call
    ) -> Response:
        async def watch() -> None:  # a client that hangs up cancels its sequences
            while not await http.is_disconnected():
                await asyncio.sleep(0.25)
            sub.cancel()

        watcher = asyncio.create_task(watch())
        try:
            while sub.open:
                await sub.next_events()
        finally:
            watcher.cancel()
            sub.cancel()
        results, err = self._outcome(sub.handles)
        if err is not None:
            return self._failed(meta["id"], endpoint, err)
        self._done(meta["id"], endpoint, results)
        if chat:
            choices = []
            for i, r in enumerate(results):
                msg, finish = message(call.reading, r.text, self._opened(r.prompt_ids), FINISH[r.finish_reason])
                choices.append(
                    {
                        "index": i,
                        "message": msg,
                        "logprobs": self._chat_logprobs(call, r.logprobs),
                        "finish_reason": finish,
                    }
                )
        else:
            choices = [self._completion_choice(call, i, r) for i, r in enumerate(results)]
        return JSONResponse(
            {
                **meta,
                "object": "chat.completion" if chat else "text_completion",
                "choices": choices,
                "usage": self._usage(results, call.n),
                "metrics": self._metrics(results[0]),
            }
        )

    def _chat_logprobs(self, call: Call, entries: Any) -> dict | None:
        return None if call.top is None else {"content": lp.chat_content(entries or [], self.texts), "refusal": None}

    def _completion_choice(self, call: Call, i: int, r: Result) -> dict:
        """A completions choice: the echoed prompt first when asked (its tokens' scores too, the
        first one None), then the answer; ``finish_reason`` length when nothing was to be generated."""
        prompt = call.prompts[i] if call.echo else ""
        logprobs = None
        if call.top is not None:
            if call.echo:
                logprobs = lp.legacy(r.prompt_ids, r.prompt_logprobs or [None] * len(r.prompt_ids), self.texts)
            logprobs = lp.merge(logprobs, lp.legacy(r.token_ids, r.logprobs or [], self.texts, len(prompt)))
        finish = "length" if call.requests[i].max_new_tokens == 0 else FINISH[r.finish_reason]
        return {"index": i, "text": prompt + r.text, "logprobs": logprobs, "finish_reason": finish}

    async def _stream(
        self, body: Sampling, http: HTTPRequest, sub: Submission, meta: dict, chat: bool, endpoint: str, call: Call
    ) -> Response:
        try:
            first = await sub.next_events()  # commit to 200 only once something is known
        except BaseException:
            sub.cancel()
            raise
        for choice, text in first:
            if text is None:
                _, err = self._outcome_of(sub, choice)
                if err is not None:
                    sub.cancel()
                    return self._failed(meta["id"], endpoint, err)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = [0] * len(sub.handles)  # per choice: log-probabilities sent so far
        deltas: list[Deltas | None] = [None] * len(sub.handles)  # per choice (chat): what its text added
        offsets = [0] * len(sub.handles)  # per choice: characters sent so far (text_offset)

        def scores(choice: int, text: str | None) -> dict | None:
            """The log-probabilities of the tokens this choice generated since its last chunk."""
            if call.top is None:
                return None
            entries = sub.handles[choice].context.logprobs[sent[choice] :]
            sent[choice] += len(entries)
            if chat:
                return self._chat_logprobs(call, entries)
            out = lp.legacy([e.token_id for e in entries], entries, self.texts, offsets[choice])
            offsets[choice] += len(text or "")
            return out

        def chunk(
            choice: int,
            text: str | None = None,
            finish: str | None = None,
            role: bool = False,
            held: dict | None = None,
        ) -> str:
            """A chunk of ``text`` (or ``held``: the delta of what a chat answer held back, sent as it is)."""
            if held is not None:
                return (
                    "data: "
                    + json.dumps(
                        {
                            **meta,
                            "object": obj,
                            "choices": [{"index": choice, "delta": held, "logprobs": None, "finish_reason": None}],
                        }
                    )
                    + "\n\n"
                )
            logprobs = None if role else scores(choice, text)
            if chat:
                delta: dict = {"role": "assistant", "content": ""} if role else {}
                if text is not None:
                    if deltas[choice] is None:
                        deltas[choice] = Deltas(call.reading, self._opened(sub.handles[choice].context.input_ids))
                    delta = deltas[choice].add(text)
                    if not delta and logprobs is None:
                        return ""  # held back (it may be a tool call starting)
                if finish == "stop" and deltas[choice] is not None and deltas[choice].called:
                    finish = "tool_calls"
                item = {"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                item = {"index": choice, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            return "data: " + json.dumps({**meta, "object": obj, "choices": [item]}) + "\n\n"

        async def lines() -> AsyncIterator[str]:
            finished: list[Result | None] = [None] * len(sub.handles)
            try:
                if chat:
                    for i in range(len(sub.handles)):
                        yield chunk(i, role=True)
                pending = first
                while True:
                    for choice, text in pending:
                        if text is not None:
                            piece = chunk(choice, text)
                            if piece:
                                yield piece
                            continue
                        result, err = self._outcome_of(sub, choice)
                        if err is not None:
                            self.metrics.requests.labels(endpoint, str(err.status)).inc()
                            log(f"{meta['id']} {err.status} (streaming) {err.message}")
                            yield (
                                "data: "
                                + json.dumps({"error": {"message": err.message, "type": err.type, "code": err.code}})
                                + "\n\n"
                            )
                            yield "data: [DONE]\n\n"
                            return
                        finished[choice] = result
                        rest = deltas[choice].flush() if deltas[choice] is not None else None
                        if rest:
                            yield chunk(choice, held=rest)
                        yield chunk(choice, finish=FINISH[result.finish_reason])
                    if not sub.open:
                        break
                    pending = await sub.next_events()
                results = [r for r in finished if r is not None]
                self._done(meta["id"], endpoint, results)
                if include_usage:
                    usage = self._usage(results, call.n)
                    yield (
                        "data: "
                        + json.dumps(
                            {**meta, "object": obj, "choices": [], "usage": usage, "metrics": self._metrics(results[0])}
                        )
                        + "\n\n"
                    )
                yield "data: [DONE]\n\n"
            finally:
                sub.cancel()  # client gone mid-stream (or done): nothing keeps running for it

        return StreamingResponse(
            lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    def _outcome_of(self, sub: Submission, choice: int) -> tuple[Result | None, APIError | None]:
        results, err = self._outcome([sub.handles[choice]])
        return (results[0] if results else None), err
