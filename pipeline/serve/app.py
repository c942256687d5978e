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
import sys
import traceback
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from pipeline.pipeline import Pipeline
from pipeline.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ServeSettings,
    TokenizeRequest,
    error_response,
)
from pipeline.serve.calls import log, refuse_unsupported
from pipeline.serve.embeddings import Embeddings, EmbeddingRequest
from pipeline.serve.models import RUNTIME_OFF, LoadLoraRequest, Models, UnloadLoraRequest
from pipeline.serve.rerank import Reranker, RerankRequest, ScoreRequest
from pipeline.serve.response_input import ResponsesRequest
from pipeline.serve.responses import Responses
from pipeline.serve.respond import Completions
from pipeline.serve.transcriptions import Transcriptions

PAGE = Path(__file__).parent / "static" / "chat.html"


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
    api = Completions(pipe, settings, draining)
    app.state.api = api
    answer_errors(app)
    app.include_router(open_routes(api, draining))
    app.include_router(api_routes(api, draining), dependencies=[Depends(bearer(settings.api_key))])
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    if settings.cors_origins:  # outermost: preflights answered, and every answer (errors too) readable
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["Retry-After"],
        )
    return app


def answer_errors(app: FastAPI) -> None:
    """Every error as OpenAI's JSON: the API's own, a body that does not validate (400 naming the
    field), an unknown route, and a crash (500, its traceback on the server's stderr only)."""

    @app.exception_handler(APIError)
    async def _api_error(_: HTTPRequest, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.type, err.code, err.headers)

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


def bearer(api_key: str | None) -> Callable[[HTTPRequest], None]:
    """The dependency of the API routes: ``Authorization: Bearer <serve.api_key>`` when one is set."""

    def authorized(http: HTTPRequest) -> None:
        if api_key is None:
            return
        scheme, _, token = http.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error", "invalid_api_key"
            )

    return authorized


def open_routes(api: Completions, draining: Callable[[], bool]) -> APIRouter:
    """What needs no key: health, the chat page, the metrics."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        if draining():
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(api.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def api_routes(api: Completions, draining: Callable[[], bool]) -> APIRouter:
    """The API: the model, its tokenizer, and an endpoint object per kind of call."""
    router, settings = APIRouter(), api.settings
    embeddings = Embeddings(api, settings.pooling, draining)
    router.include_router(tokenizer_routes(api))
    router.include_router(answer_routes(api, draining))
    router.include_router(reranker_routes(Reranker(api, draining)))
    router.include_router(adapter_routes(api.models) if settings.runtime_lora else adapter_routes_off())

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        base = {"max_model_len": api.requests.context(), "embedding": embeddings.describe()}
        return JSONResponse({"object": "list", "data": api.models.cards(base)})

    @router.post("/v1/embeddings")
    async def embed(body: EmbeddingRequest, http: HTTPRequest) -> Response:
        return await embeddings.create(body, http)

    return router


def tokenizer_routes(api: Completions) -> APIRouter:
    """vLLM's tokenizer endpoints (lm-eval's remote tokenizer uses them)."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(api.requests.tokenize, body))

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(api.requests.detokenize, body))

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(api.requests.tokenizer_info())

    return router


def answer_routes(api: Completions, draining: Callable[[], bool]) -> APIRouter:
    """What generates: chat and text completions, the Responses API, transcriptions."""
    router = APIRouter()
    responses = Responses(api, draining, api.settings.max_stored_responses)
    transcriptions = Transcriptions(api, draining)

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: HTTPRequest) -> Response:
        return await api.complete(body, http, chat=True)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest) -> Response:
        return await api.complete(body, http, chat=False)

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, http: HTTPRequest) -> Response:
        return await responses.create(body, http)

    @router.get("/v1/responses/{rid}")
    async def get_response(rid: str) -> JSONResponse:
        return responses.retrieve(rid)

    @router.delete("/v1/responses/{rid}")
    async def delete_response(rid: str) -> JSONResponse:
        return responses.delete(rid)

    @router.post("/v1/audio/transcriptions")
    async def transcribe(http: HTTPRequest) -> Response:
        return await transcriptions.create(http)  # a multipart form, read by the endpoint itself

    return router


def reranker_routes(reranker: Reranker) -> APIRouter:
    """Relevance: rerank (with vLLM's aliases) and score."""
    router = APIRouter()

    @router.post("/v1/rerank")
    @router.post("/v2/rerank")
    @router.post("/rerank")
    async def rerank(body: RerankRequest, http: HTTPRequest) -> Response:
        return await reranker.rerank(body, http)  # rendering, submission and reading: off the loop

    @router.post("/score")
    @router.post("/v1/score")
    async def score(body: ScoreRequest, http: HTTPRequest) -> Response:
        return await reranker.score(body, http)

    return router


LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def adapter_routes(models: Models) -> APIRouter:
    """vLLM's runtime LoRA endpoints: load an adapter (read off the loop) and unload one, answered
    with vLLM's texts; each change logged."""
    router = APIRouter()

    @router.post(LORA_ROUTES[0])
    async def load(body: LoadLoraRequest) -> PlainTextResponse:
        refuse_unsupported(body)
        text = await asyncio.to_thread(models.load, body.lora_name, body.lora_path)
        log(f"adapter {body.lora_name!r} loaded from {body.lora_path}")
        return PlainTextResponse(text)

    @router.post(LORA_ROUTES[1])
    async def unload(body: UnloadLoraRequest) -> PlainTextResponse:
        refuse_unsupported(body)
        text = models.unload(body.lora_name)
        log(f"adapter {body.lora_name!r} unloaded")
        return PlainTextResponse(text)

    return router


def adapter_routes_off() -> APIRouter:
    """``serve.runtime_lora=false``: both endpoints a 404 saying so, whatever the body."""
    router = APIRouter()

    async def off() -> JSONResponse:
        return error_response(404, RUNTIME_OFF, code="not_found")

    for path in LORA_ROUTES:
        router.add_api_route(path, off, methods=["POST"])
    return router
