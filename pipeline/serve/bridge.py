"""Between the event loop and the engine: each request's events (text pieces, ends), produced on
the engine's thread, carried to the loop without ever blocking it."""

from __future__ import annotations

import asyncio
from collections import deque
from functools import partial
from typing import Any

from pipeline.engine import Handle


class Submission:
    """The handles of one HTTP request (``n`` choices) and their events, read on the loop with
    ``next_events``: ``(choice, text)`` for new text, ``(choice, None)`` when that choice ends.

    The engine's thread appends events to a deque and wakes the loop only when no wake-up is
    pending: the tokens of one engine step (or decode burst) cost one wake-up, not one each.
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.handles: list[Handle] = []
        self._events: deque[tuple[int, str | None]] = deque()  # appended on the engine's thread
        self._ready = asyncio.Event()
        self._wake_pending = False
        self._ended = 0

    def on_text(self, choice: int) -> Any:
        return partial(self._put, choice)

    def track(self, handle: Handle) -> None:
        choice = len(self.handles)
        self.handles.append(handle)
        handle.add_done_callback(lambda _: self._put(choice, None))

    def _put(self, choice: int, text: str | None) -> None:
        self._events.append((choice, text))
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed (server shut down): nobody is listening
            pass

    def _wake(self) -> None:  # on the loop: cleared before reading, so a later event wakes it again
        self._wake_pending = False
        self._ready.set()

    @property
    def open(self) -> int:
        """Choices not ended yet (as far as the events read so far tell)."""
        return len(self.handles) - self._ended

    async def next_events(self) -> list[tuple[int, str | None]]:
        """Every event queued now (waiting for one), with consecutive text pieces of one choice
        joined: tokens that arrive together (a decode burst) go out as one chunk."""
        while not self._events:
            self._ready.clear()
            if self._events:
                break
            await self._ready.wait()
        events = []
        while self._events:
            events.append(self._events.popleft())
        merged: list[tuple[int, str | None]] = []
        for choice, text in events:
            if text is not None and merged and merged[-1][0] == choice and merged[-1][1] is not None:
                merged[-1] = (choice, merged[-1][1] + text)
            else:
                merged.append((choice, text))
        self._ended += sum(text is None for _, text in events)
        return merged

    def cancel(self) -> None:
        """Cancel what is still running (client gone, server draining): blocks freed at the next step."""
        for handle in self.handles:
            if not handle.done():
                handle.cancel()
