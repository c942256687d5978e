"""What every endpoint does around the engine, in one place: a call refused before it starts
(the server draining, a field it does not implement, a model it does not serve); its sequences waited for,
cancelled when the client hangs up; their outcome mapped to the API error a failure means; the
call counted in ``/metrics`` and logged in one line."""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from pipeline.context import Result
from pipeline.engine import Cancelled, Handle
from pipeline.errors import UserError
from pipeline.serve.bridge import Submission
from pipeline.serve.models import Models, Target
from pipeline.serve.prometheus import ServerMetrics
from pipeline.serve.protocol import APIError, error_response


def log(line: str) -> None:
    """One line of the server's log, on stderr (stdout is not the server's)."""
    print(line, file=sys.stderr, flush=True)


def admit(body: Any, models: Models, draining: Callable[[], bool]) -> Target:
    """Refuse a call before anything runs: 503 while draining, 400 naming the top-level fields the
    server does not implement (``body.unsupported()``), 404 for a model it does not serve; else
    what ``body.model`` names (the base model or a loaded adapter: ``Models.resolve``)."""
    if draining():
        raise APIError(503, "the server is shutting down", "unavailable", "draining")
    refuse_unsupported(body)
    return models.resolve(body.model)


def refuse_unsupported(body: Any) -> None:
    """400 naming the top-level fields of ``body`` the server does not implement."""
    unsupported = body.unsupported()
    if unsupported:
        raise APIError(
            400,
            f"{', '.join(unsupported)}: not supported by this server (docs/serve.md lists the fields it implements)",
            code="unsupported_parameter",
        )


def outcome(handles: list[Handle]) -> tuple[list[Result] | None, APIError | None]:
    """The ended handles' results, or the API error their first failure maps to."""
    try:
        return [handle.result() for handle in handles], None
    except UserError as err:
        return None, APIError(400, str(err), code="invalid_value")
    except Cancelled:
        return None, APIError(499, "cancelled", "cancelled")
    except Exception as err:  # a failed forward: reported, never a traceback to the client
        traceback.print_exception(err, file=sys.stderr)
        return None, APIError(500, f"internal error ({type(err).__name__}: {err})", "server_error")


async def wait_all(http: HTTPRequest, sub: Submission) -> None:
    """Until every sequence of the call ended; a client that hangs up meanwhile cancels them."""

    async def watch() -> None:
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


class Gate:
    """``serve.max_waiting``: a call whose sequences would take the engine's waiting queue past
    the bound is refused at once (503 with ``Retry-After``), never queued without end; those in
    flight are untouched. The check and the submission happen under one lock (``admitting``), so
    calls arriving together cannot overshoot the bound between them."""

    RETRY_AFTER_S = 1

    def __init__(self, engine: Any, limit: int | None) -> None:
        self.engine, self.limit = engine, limit
        self._lock = threading.Lock()

    @contextmanager
    def admitting(self, sequences: int) -> Iterator[None]:
        """Submit ``sequences`` inside this block (on a worker thread), or get the 503."""
        with self._lock:
            waiting = self.engine.waiting
            if self.limit is not None and waiting + sequences > self.limit:
                raise APIError(
                    503,
                    f"the server is busy: {waiting} requests wait (serve.max_waiting={self.limit}); retry shortly",
                    "unavailable",
                    "overloaded",
                    headers={"Retry-After": str(self.RETRY_AFTER_S)},
                )
            yield


class Ledger:
    """Each call's end in the server's metrics and log."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def refused(self, rid: str, endpoint: str, err: APIError) -> JSONResponse:
        """A failed call counted and logged, and its JSON error."""
        self.failed(rid, endpoint, err)
        return error_response(err.status, err.message, err.type, err.code, err.headers)

    def failed(self, rid: str, endpoint: str, err: APIError, where: str = "") -> None:
        """A failed call counted and logged (``where``: `` (streaming)`` once its stream began)."""
        self.metrics.requests.labels(endpoint, str(err.status)).inc()
        log(f"{rid} {err.status}{where} {err.message}")

    def done(self, rid: str, endpoint: str, results: list[Result], line: str) -> None:
        """A call answered: its sequences' metrics counted, ``line`` logged after its id and status."""
        for result in results:
            self.metrics.finished(result.metrics, result.finish_reason)
        self.metrics.requests.labels(endpoint, "200").inc()
        log(f"{rid} 200 {line}")
