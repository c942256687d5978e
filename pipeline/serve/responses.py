"""``POST /v1/responses`` (OpenAI's Responses API) over the chat path.

A Responses request becomes a chat completion request (``ChatCompletionRequest``: ``instructions``
a system message first, the ``input`` items as chat messages, flat function tools in the chat
shape, ``text.format`` as ``response_format``) and goes through the same ``Renderer`` and engine,
so its answer is token for token the chat completion of the same messages. The answer comes back
as Responses' output items (a ``reasoning`` item, the ``message``, ``function_call`` items), whole
or as Responses' semantic stream events (``response.created`` ... ``response.completed``).

``previous_response_id`` continues a stored response: responses are kept in memory (unless
``store: false``) in an LRU of ``serve.max_stored_responses``, each with its conversation (the
input messages, earlier turns included, and its output as the assistant's message); a follow-up's
conversation is that one plus the new input, so its prompt begins with the earlier one and the
engine's prefix cache holds it. ``instructions`` are not carried over, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pipeline.context import Result
from pipeline.errors import UserError
from pipeline.serve.answer import Deltas, message
from pipeline.serve.bridge import Submission
from pipeline.serve.calls import admit, outcome, wait_all
from pipeline.serve.protocol import FINISH, APIError, Call
from pipeline.serve.respond import reported_metrics, usage
from pipeline.serve.response_input import ResponsesRequest, chat_request
from pipeline.serve.response_output import Output, assistant_message, new_id, whole_delta

ENDPOINT = "responses"

# --- the store of responses -------------------------------------------------------------------


class Store:
    """Stored responses and their conversations, the least recently used dropped past ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._entries[response["id"]] = (response, conversation)
            self._entries.move_to_end(response["id"])
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is not None:
                self._entries.move_to_end(rid)
            return entry

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._entries.pop(rid, None) is not None


def not_found(rid: str, what: str = "response", code: str = "response_not_found") -> APIError:
    return APIError(404, f"{what} {rid!r} not found (never stored, stored with store: false, or dropped)", code=code)


# --- the endpoint -------------------------------------------------------------------------------


class Responses:
    """The endpoint over the completions' pipeline (``api``: ``respond.Completions``: its renderer
    reads the chat request, its ledger counts the calls)."""

    def __init__(self, api: Any, draining: Callable[[], bool], max_stored: int) -> None:
        self.api, self.pipe, self.settings, self.draining = api, api.pipe, api.settings, draining
        self.store = Store(max_stored)
        self.think_end = None if api.requests.think_ids is None else api.requests.think_ids[1]

    def retrieve(self, rid: str) -> JSONResponse:
        entry = self.store.get(rid)
        if entry is None:
            raise not_found(rid)
        return JSONResponse(entry[0])

    def delete(self, rid: str) -> JSONResponse:
        if not self.store.delete(rid):
            raise not_found(rid)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def create(self, body: ResponsesRequest, http: HTTPRequest) -> Response:
        rid = new_id("resp")
        sub = Submission()
        try:
            admit(body, self.api.models, self.draining)
            history: list[dict] = []
            if body.previous_response_id is not None:
                entry = self.store.get(body.previous_response_id)
                if entry is None:
                    raise not_found(body.previous_response_id, "previous_response_id", "previous_response_not_found")
                history = entry[1]
            chat, conversation = chat_request(body, history)
            target, tokens = self.api.requests.check(chat, chat.max_completion_tokens)
            call = await asyncio.to_thread(self.api.requests.call, chat, True, tokens, target)
            await asyncio.to_thread(self._submit, sub, rid, call, body.stream)
        except UserError as err:
            sub.cancel()
            return self.api.ledger.refused(rid, ENDPOINT, APIError(400, str(err), code="invalid_value"))
        except APIError as err:
            sub.cancel()
            return self.api.ledger.refused(rid, ENDPOINT, err)
        turn = Turn(self, body, rid, call, conversation)
        if body.stream:
            return await self._stream(sub, turn)
        await wait_all(http, sub)
        results, err = outcome(sub.handles)
        if err is not None:
            return self.api.ledger.refused(rid, ENDPOINT, err)
        result = results[0]
        msg, finish = message(call.reading, result.text, self.api.requests.opened(result.prompt_ids), "stop")
        output = Output()
        output.add(whole_delta(msg))
        output.finish(turn.status(result))
        return JSONResponse(turn.done(result, output.items))

    def _submit(self, sub: Submission, rid: str, call: Call, stream: bool) -> None:
        """The one sequence queued (off the event loop: a submission may touch the device), or the
        503 of a full queue (``serve.max_waiting``)."""
        request = call.requests[0]
        request.id = f"{rid}-0"
        with self.api.gate.admitting(1):
            sub.track(self.pipe.submit(request, on_text=sub.on_text(0) if stream else None))

    async def _stream(self, sub: Submission, turn: Turn) -> Response:
        """Committed (200) once the first events are known: a failure before any text is the JSON error."""
        try:
            first = await sub.next_events()
        except BaseException:
            sub.cancel()
            raise
        if any(text is None for _, text in first):
            _, err = self.api.outcome_of(sub, 0)
            if err is not None:
                sub.cancel()
                return self.api.ledger.refused(turn.rid, ENDPOINT, err)
        return StreamingResponse(
            turn.events(sub, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


class Turn:
    """One response being made: its object (``skeleton``), its end (usage, stored), its stream."""

    def __init__(self, owner: Responses, body: ResponsesRequest, rid: str, call: Call, conversation: list[dict]):
        self.owner, self.body, self.rid, self.call, self.conversation = owner, body, rid, call, conversation
        self.created = int(time.time())

    def status(self, result: Result) -> str:
        return "incomplete" if FINISH[result.finish_reason] == "length" else "completed"

    def skeleton(self, status: str, output: list[dict]) -> dict:
        body = self.body
        tools = [
            {"type": "function", **{k: t.get(k) for k in ("name", "description", "parameters", "strict")}}
            for t in body.tools or []
        ]
        text = {"format": ((body.text or {}).get("format") or {"type": "text"}), "verbosity": None}
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.call.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "store": body.store is not False,
            "temperature": body.temperature,
            "text": text,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": tools,
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def done(self, result: Result, items: list[dict]) -> dict:
        """The whole response, counted, logged and stored (unless ``store: false``)."""
        self.owner.api.count_done(self.rid, ENDPOINT, [result])
        response = self.skeleton(self.status(result), items)
        response["usage"] = self.usage(result, items)
        response["metrics"] = reported_metrics(result)
        if self.body.store is not False and self.owner.store.limit > 0:
            self.owner.store.put(response, self.conversation + [assistant_message(items)])
        return response

    def usage(self, result: Result, items: list[dict]) -> dict:
        chat = usage([result], 1)
        reasoning = 0
        if any(item["type"] == "reasoning" for item in items):
            ids = list(result.token_ids)
            end = self.owner.think_end
            reasoning = ids.index(end) + 1 if end is not None and end in ids else len(ids)
        return {
            "input_tokens": chat["prompt_tokens"],
            "input_tokens_details": chat["prompt_tokens_details"],
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": chat["total_tokens"],
        }

    async def events(self, sub: Submission, first: list[tuple[int, str | None]]) -> AsyncIterator[str]:
        """``response.created`` and ``response.in_progress``, each piece of text as the events it
        makes (read off the text as the chat stream reads it), the items done, then
        ``response.completed`` (``response.incomplete`` when cut at max_output_tokens) with the
        whole response; a failure ends the stream with ``response.failed``."""
        output = Output()
        api = self.owner.api
        deltas: Deltas | None = None
        try:
            yield output.event("response.created", response=self.skeleton("in_progress", []))
            yield output.event("response.in_progress", response=self.skeleton("in_progress", []))
            pending = first
            while True:
                for _, text in pending:
                    if text is not None:
                        if deltas is None:
                            opened = api.requests.opened(sub.handles[0].context.input_ids)
                            deltas = Deltas(self.call.reading, opened)
                        for event in output.add(deltas.add(text)):
                            yield event
                        continue
                    result, err = api.outcome_of(sub, 0)
                    if err is not None:
                        api.ledger.failed(self.rid, ENDPOINT, err, " (streaming)")
                        failed = self.skeleton("failed", output.items)
                        code = "server_error" if err.status >= 500 else (err.code or "invalid_prompt")
                        failed["error"] = {"code": code, "message": err.message}
                        yield output.event("response.failed", response=failed)
                        return
                    rest = deltas.flush() if deltas is not None else {}
                    status = self.status(result)
                    for event in output.add(rest) + output.finish(status):
                        yield event
                    kind = "response.completed" if status == "completed" else "response.incomplete"
                    yield output.event(kind, response=self.done(result, output.items))
                    return
                if not sub.open:
                    return
                pending = await sub.next_events()
        finally:
            sub.cancel()  # client gone mid-stream (or done): nothing keeps running for it
