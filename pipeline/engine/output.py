"""The host side of a sequence's tokens: detokenisation, streaming, stop checks, the final text."""

from __future__ import annotations

from typing import Any, Callable, Sequence as Seq

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2 byte-level BPE alphabet


class TextStream:
    """Incremental detokenisation: ``text`` is the complete text so far (never half a UTF-8
    character), equal to ``tokenizer.decode(ids, skip_special_tokens=True)`` once complete.

    Why: re-decoding the whole answer for every token is quadratic in its length; here each token
    decodes only a few recent ids and ``text`` grows by appending.  Tokenizers with a
    ``tokenizers`` backend use that library's own ``DecodeStream``; others a window of ids through
    ``tokenizer.decode`` (vLLM's prefix/read offsets).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._backend = _fast_backend(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True)
        self._prefix = 0  # window path: ids[_prefix:_read] give context to the pending ids
        self._read = 0  # window path: the text of ids[:_read] is already in ``text``

    def push(self, token_id: int) -> None:
        """Add the next token id; append to ``text`` whatever complete text it finishes."""
        self.ids.append(token_id)
        piece = self._step_fast(token_id) if self._backend is not None else self._step_window()
        if piece:
            self.text += piece

    def _step_fast(self, token_id: int) -> str | None:
        """tokenizers' own incremental decoder (it keeps the few ids of context itself)."""
        try:
            return self._stream.step(self._backend, int(token_id))
        except Exception as e:  # a decoder whose output is not prefix-stable: restart from here
            if "Invalid prefix" not in str(e):
                raise
            self._stream = DecodeStream(skip_special_tokens=True)
            return self._stream.step(self._backend, int(token_id))

    def _step_window(self) -> str | None:
        """Decode ids[_prefix:] against ids[_prefix:_read]; the difference is new text once it
        no longer ends in U+FFFD (a character still missing bytes)."""
        before = self.tokenizer.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]


def _fast_backend(tokenizer: Any) -> Tokenizer | None:
    """The ``tokenizers.Tokenizer`` whose ``decode`` is exactly ``tokenizer.decode``, if any (not
    when transformers cleans up spaces after it, which ``DecodeStream`` would not)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend
    return None


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
    ``eos``: token ids that end the answer (empty with ``ignore_eos``); ``stop_ids``: token ids
    that end it too (``Request.stop_token_ids``); ``min_new_tokens``: none of these ends an
    answer shorter than this (the sampler never picks the ids: ``held``; stop strings are looked
    for only in the text that comes after).
    """

    def __init__(
        self,
        tokenizer: Any,
        max_new_tokens: int,
        stops: Seq[str],
        eos: frozenset,
        on_text: Callable[[str], None] | None,
        stop_ids: frozenset = frozenset(),
        min_new_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.stops = [s for s in stops if s]
        self.eos, self.stop_ids, self.min_new_tokens = eos, stop_ids, min_new_tokens
        self.ends = eos | stop_ids  # the ids held back below min_new_tokens
        self.on_text = on_text
        self.stream = TextStream(tokenizer) if on_text is not None or self.stops else None
        self.emitted = 0
        self._scanned = 0  # text before this was searched for stop strings already
        self._stop_at: int | None = None  # where the stop string that ended the answer begins

    def held(self, generated: int) -> bool:
        """Whether, with ``generated`` tokens so far, the next token may not end the answer."""
        return generated < self.min_new_tokens

    def accept(self, generated: Seq[int]) -> str | None:
        """The newest of ``generated`` arrived: stream it; the finish reason if the answer ends."""
        token_id, early = generated[-1], len(generated) <= self.min_new_tokens
        if self.stream is not None:
            self.stream.push(token_id)
            if self._stopped(self.stream.text, early):
                return "stop"
            self._emit(self.stream.text, holdback(self.stream.text, self.stops))
        if token_id in self.eos and not early:
            return "eos"
        if token_id in self.stop_ids and not early:
            return "stop"
        if len(generated) >= self.max_new_tokens:
            return "length"
        return None

    def _stopped(self, text: str, early: bool = False) -> bool:
        """Whether a stop string appeared; only the new text (and the tail a stop string could
        straddle) is searched, so the checks stay linear in the answer's length. ``early``: the
        answer is under ``min_new_tokens``: its text is passed over, never searched."""
        if not self.stops:
            return False
        start = max(0, self._scanned - max(map(len, self.stops)) + 1)
        self._scanned = len(text)
        if early:
            return False
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self._stop_at = min(found)
        return bool(found)

    def final_text(self, generated: Seq[int], finish_reason: str | None) -> str:
        """The whole answer (cut before the stop string that ended it), with the rest of the stream sent."""
        text = self.tokenizer.decode(list(generated), skip_special_tokens=True)
        if finish_reason == "stop" and self._stop_at is not None:
            text = text[: self._stop_at]
        self._emit(text, 0)
        return text

    def _emit(self, text: str, hold: int) -> None:
        """Stream text[emitted : len(text) - hold]."""
        upto = len(text) - hold
        if self.on_text is not None and upto > self.emitted:
            self.on_text(text[self.emitted : upto])
        self.emitted = max(self.emitted, upto)


class TokenTexts:
    """Each token id's text (the tokenizer's decoding of it alone) and its UTF-8 bytes, remembered.

    A token that is part of a multi-byte character decodes to U+FFFD alone; its ``bytes`` are its
    own raw bytes (byte-level BPE's alphabet, or SentencePiece's ``<0xNN>`` byte tokens), so that a
    client joining the bytes of consecutive tokens gets the character back, as OpenAI intends."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._byte_of = {c: b for b, c in bytes_to_unicode().items()}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    def bytes(self, token: int) -> list[int]:
        text = self(token)
        if "\ufffd" not in text:
            return list(text.encode("utf-8"))
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str) and piece and all(c in self._byte_of for c in piece):
            return [self._byte_of[c] for c in piece]
        if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return [int(piece[3:5], 16)]
        return list(text.encode("utf-8"))
