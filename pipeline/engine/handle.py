"""What ``submit`` returns: the caller's side of one request in flight."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator, Protocol


class Cancelled(Exception):
    """The request was cancelled from its handle before it finished."""


class Driver(Protocol):
    """The engine as a handle sees it: waiting drives its steps (``Engine.drive``)."""

    def drive(self, until: Callable[[], bool], timeout: float | None = None) -> None: ...

    def wake(self) -> None: ...


class Handle:
    """Iterate for token ids as they come; ``result()`` waits for the end; ``cancel()`` stops it."""

    def __init__(self, engine: Driver, seq: Any) -> None:
        self._engine = engine
        self._seq = seq
        self._done = threading.Event()
        self._tokens: queue.Queue = queue.Queue()
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Handle"], None]] = []
        self._lock = threading.Lock()

    def push(self, token_id: int) -> None:
        """(engine) A new token of this request."""
        self._tokens.put(token_id)

    def finish(self, value: Any = None, error: BaseException | None = None) -> None:
        """(engine) The request ended with ``value`` or ``error``."""
        self._value, self._error = value, error
        with self._lock:
            self._done.set()
            callbacks = list(self._callbacks)
        self._tokens.put(None)
        for fn in callbacks:
            fn(self)

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call ``fn(handle)`` when the request ends (at once if it has), on the thread that stepped."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    @property
    def context(self) -> Any:
        return self._seq.ctx

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop the request; its blocks are returned at the engine's next step."""
        self._seq.cancelled = True
        self._engine.wake()

    def wait(self) -> None:
        """Drive the engine until this request has ended (e.g. after ``cancel``)."""
        self._engine.drive(self.done)

    def result(self, timeout: float | None = None) -> Any:
        """The finished request (a Result, or the Context for context runs); raises its error.
        Waiting drives the engine (see ``Engine.drive``)."""
        self._engine.drive(self._done.is_set, timeout)
        if not self._done.is_set():
            raise TimeoutError("the request is still running")
        if self._error is not None:
            raise self._error
        return self._value

    def __iter__(self) -> Iterator[int]:
        while True:
            self._engine.drive(lambda: not self._tokens.empty())
            token = self._tokens.get()
            if token is None:
                if self._error is not None and not isinstance(self._error, Cancelled):
                    raise self._error
                return
            yield token
