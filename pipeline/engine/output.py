"""The host side of a sequence's tokens: detokenisation, streaming, stop checks, the final text."""
from __future__ import annotations

from typing import Any, Callable, Sequence as Seq


class TextStream:
    """Incremental detokenisation: emits only text that is complete (no half UTF-8 characters)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.text = text


def holdback(text: str, stops: Seq[str]) -> int:
    """Length of the longest tail of ``text`` that could still grow into a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class Output:
    """What a generating sequence does with each new token: stream its text (held back while it
    could still become a stop string), and say when it ends (EOS, a stop string, the length).

    ``on_text``: the streaming callback (None: no streaming); ``stops``: stop strings;
    ``eos``: token ids that end the answer (empty with ``ignore_eos``).
    """

    def __init__(self, tokenizer: Any, max_new_tokens: int, stops: Seq[str], eos: frozenset,
                 on_text: Callable[[str], None] | None) -> None:
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.stops = [s for s in stops if s]
        self.eos = eos
        self.on_text = on_text
        self.stream = TextStream(tokenizer) if on_text is not None or self.stops else None
        self.emitted = 0

    def accept(self, generated: Seq[int]) -> str | None:
        """The newest of ``generated`` arrived: stream it; the finish reason if the answer ends."""
        token_id = generated[-1]
        if self.stream is not None:
            self.stream.push(token_id)
            if self.stops and any(s in self.stream.text for s in self.stops):
                return "stop"
            self._emit(self.stream.text, holdback(self.stream.text, self.stops))
        if token_id in self.eos:
            return "eos"
        if len(generated) >= self.max_new_tokens:
            return "length"
        return None

    def final_text(self, generated: Seq[int], finish_reason: str | None) -> str:
        """The whole answer (cut before a stop string), with the rest of the stream sent."""
        text = self.tokenizer.decode(list(generated), skip_special_tokens=True)
        if finish_reason == "stop":
            text = text[: min((text.find(s) for s in self.stops if s in text), default=len(text))]
        self._emit(text, 0)
        return text

    def _emit(self, text: str, hold: int) -> None:
        """Stream text[emitted : len(text) - hold]."""
        upto = len(text) - hold
        if self.on_text is not None and upto > self.emitted:
            self.on_text(text[self.emitted : upto])
        self.emitted = max(self.emitted, upto)
