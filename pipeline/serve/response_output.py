"""The Responses API's answer: output items (reasoning, message, function calls) built from the
chat answer's deltas, whole or as Responses' semantic stream events.
"""

from __future__ import annotations

import json
import uuid
from typing import Any


# --- the output items -------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _sse(payload: dict) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"


class Output:
    """A response's output items built from chat deltas (``{"reasoning_content", "content",
    "tool_calls"}``: the stream's, or a whole answer as one), with the Responses events each step
    sends: an item added, its text or arguments growing, the item done. Reasoning is a
    ``reasoning`` item, content a ``message`` item, each call a ``function_call`` item, in the order
    they come; an item is done when the next begins or the answer ends."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.open: int | None = None  # the item still growing
        self.seq = 0  # the next event's sequence_number

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return _sse(payload)

    def add(self, delta: dict) -> list[str]:
        events: list[str] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):
                events += self._start(
                    {
                        "type": "function_call",
                        "id": new_id("fc"),
                        "call_id": call["id"],
                        "name": fn.get("name", ""),
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
            arguments = fn.get("arguments") or ""
            if arguments and self.open is not None and self.items[self.open]["type"] == "function_call":
                item = self.items[self.open]
                item["arguments"] += arguments
                events.append(self._delta("response.function_call_arguments.delta", arguments))
        return events

    def finish(self, status: str) -> list[str]:
        """The last item done (with the response's ``status``: ``incomplete`` when cut short); a
        message item, empty, when the answer has neither text nor calls."""
        events = self._close(status)
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            events += self._start(self._message()) + self._close(status)
        return events

    def _text(self, kind: str, text: str) -> list[str]:
        events = []
        if self.open is None or self.items[self.open]["type"] != kind:
            events += self._start(self._message() if kind == "message" else self._reasoning())
        item = self.items[self.open]
        item["content"][0]["text"] += text
        name = "output_text" if kind == "message" else "reasoning_text"
        delta = {"logprobs": []} if kind == "message" else {}
        return events + [self._delta(f"response.{name}.delta", text, content_index=0, **delta)]

    @staticmethod
    def _message() -> dict:
        return {"type": "message", "id": new_id("msg"), "role": "assistant", "status": "in_progress", "content": []}

    @staticmethod
    def _reasoning() -> dict:
        return {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [], "status": "in_progress"}

    def _delta(self, kind: str, delta: str, **fields: Any) -> str:
        item = self.items[self.open]
        return self.event(kind, item_id=item["id"], output_index=self.open, delta=delta, **fields)

    def _start(self, item: dict) -> list[str]:
        events = self._close("completed")
        self.items.append(item)
        self.open = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": self.open, "content_index": 0}
        events.append(self.event("response.output_item.added", output_index=self.open, item=_copy(item)))
        if item["type"] == "message":
            item["content"].append({"type": "output_text", "text": "", "annotations": []})
        elif item["type"] == "reasoning":
            item["content"].append({"type": "reasoning_text", "text": ""})
        else:
            return events
        return events + [self.event("response.content_part.added", **where, part=dict(item["content"][0]))]

    def _close(self, status: str) -> list[str]:
        if self.open is None:
            return []
        index, item = self.open, self.items[self.open]
        self.open = None
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events.append(
                    self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
                )
            else:
                events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=dict(part)))
        return events + [self.event("response.output_item.done", output_index=index, item=_copy(item))]


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


def whole_delta(msg: dict) -> dict:
    """A whole chat answer (``answer.message``) as one delta for ``Output``."""
    calls = [
        {
            "index": i,
            "id": c["id"],
            "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
        }
        for i, c in enumerate(msg.get("tool_calls") or [])
    ]
    return {"reasoning_content": msg.get("reasoning_content"), "content": msg.get("content"), "tool_calls": calls}


def assistant_message(items: list[dict]) -> dict:
    """The output as the chat assistant message a follow-up's conversation carries (no reasoning:
    a chat client sends none back)."""
    texts = [item["content"][0]["text"] for item in items if item["type"] == "message"]
    calls = [
        {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
        for it in items
        if it["type"] == "function_call"
    ]
    out: dict = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        out["tool_calls"] = calls
    return out
