"""Between the event loop and the engine: each request's events (text pieces, ends), produced on
the engine's thread, carried to the loop without ever blocking it."""
from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, AsyncIterator

from pipeline.engine import Handle


class Submission:
    """The handles of one HTTP request (``n`` choices) and an async stream of their events:
    ``(choice, text)`` for each new piece of text, ``(choice, None)`` when that choice ends."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles: list[Handle] = []

    def on_text(self, choice: int) -> Any:
        return partial(self._put, choice)

    def track(self, handle: Handle) -> None:
        choice = len(self.handles)
        self.handles.append(handle)
        handle.add_done_callback(lambda _: self._put(choice, None))

    def _put(self, choice: int, text: str | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (choice, text))
        except RuntimeError:  # the loop is closed (server shut down): nobody is listening
            pass

    async def events(self) -> AsyncIterator[tuple[int, str | None]]:
        left = len(self.handles)
        while left:
            choice, text = await self.queue.get()
            left -= text is None
            yield choice, text

    def cancel(self) -> None:
        """Cancel what is still running (client gone, server draining): blocks freed at the next step."""
        for handle in self.handles:
            if not handle.done():
                handle.cancel()
