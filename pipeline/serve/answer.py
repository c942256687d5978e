"""A chat answer in OpenAI's shape: content, a thinking model's ``reasoning_content`` (vLLM's
field) and ``tool_calls`` read from the text (``pipeline.structured.tools.parse``), whole or as stream deltas
(a call's id and name first, then its argument fragments), so the deltas of a stream assemble to
the whole answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.structured.tools import Call, parse


@dataclass
class Reading:
    """How to read one request's answers: the tool-call format (None: no tools asked, or
    ``tool_choice: none``), each function's parameter schema, whether the model thinks in
    ``<think>`` blocks and whether the prompt opened one."""

    fmt: str | None = None
    params: dict = field(default_factory=dict)
    thinks: bool = False

    def parse(self, text: str, opened: bool, streaming: bool = False) -> Any:
        if not (self.thinks or self.fmt):
            return None
        return parse(text, self.fmt, opened and self.thinks, self.params, streaming)


def message(reading: Reading, text: str, opened: bool, finish: str) -> tuple[dict, str]:
    """The whole answer's ``message`` and its ``finish_reason`` (``tool_calls`` when it calls one)."""
    parsed = reading.parse(text, opened)
    if parsed is None:
        return {"role": "assistant", "content": text}, finish
    calls = [c for c in parsed.calls if c.complete]
    out: dict = {"role": "assistant", "content": parsed.content or (None if calls else "")}
    if parsed.reasoning is not None:
        out["reasoning_content"] = parsed.reasoning
    if calls:
        out["tool_calls"] = [_call(c) for c in calls]
        if finish == "stop":
            finish = "tool_calls"
    return out, finish


def _call(c: Call) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


class Deltas:
    """One streamed choice: the text so far, and what of it was sent (reasoning, content, each
    call's name and arguments), so each new piece of text becomes the delta it adds."""

    def __init__(self, reading: Reading, opened: bool) -> None:
        self.reading, self.opened = reading, opened
        self.text = ""
        self.sent = {"reasoning_content": 0, "content": 0}
        self.calls: list[tuple[str, int]] = []  # (id, argument characters sent)

    def add(self, piece: str) -> dict:
        self.text += piece
        parsed = self.reading.parse(self.text, self.opened, streaming=True)
        return {"content": piece} if parsed is None else self._delta(parsed)

    def _delta(self, parsed: Any) -> dict:
        delta: dict = {}
        for key, value in (("reasoning_content", parsed.reasoning or ""), ("content", parsed.content)):
            if len(value) > self.sent[key]:
                delta[key] = value[self.sent[key] :]
                self.sent[key] = len(value)
        calls = self._calls(parsed.calls)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _calls(self, calls: list[Call]) -> list[dict]:
        out = []
        for i, c in enumerate(calls):
            if i == len(self.calls):  # a new call: its id and name first
                self.calls.append((c.id, 0))
                out.append({"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}})
            call_id, sent = self.calls[i]
            if len(c.arguments) > sent:
                out.append({"index": i, "function": {"arguments": c.arguments[sent:]}})
                self.calls[i] = (call_id, len(c.arguments))
        return out

    def flush(self) -> dict:
        """At the end: what the whole answer has that the stream held back (text that might have
        begun a call or a tag, trailing whitespace), as one last delta (empty: nothing)."""
        parsed = self.reading.parse(self.text, self.opened)
        return {} if parsed is None else self._delta(parsed)

    @property
    def called(self) -> bool:
        return bool(self.calls)
