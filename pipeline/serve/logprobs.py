"""Log-probabilities in OpenAI's two response shapes, from the engine's ``TokenLogprob`` entries:
chat's ``logprobs.content`` list (token, logprob, bytes, top_logprobs) and the legacy
completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset)."""
from __future__ import annotations

from typing import Any, Sequence

from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2 byte-level BPE alphabet

from pipeline.context import TokenLogprob, json_logprob


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


def chat_content(entries: Sequence[TokenLogprob], texts: TokenTexts) -> list[dict]:
    """Chat's ``choices[].logprobs.content``: one item per generated token."""

    def item(token: int, logprob: float) -> dict:
        return {"token": texts(token), "logprob": json_logprob(logprob), "bytes": texts.bytes(token)}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]


def legacy(ids: Sequence[int], entries: Sequence[TokenLogprob | None], texts: TokenTexts, offset: int = 0) -> dict:
    """The completions' ``choices[].logprobs`` for tokens ``ids`` (an entry of None: no score, as
    an echoed prompt's first token), ``text_offset`` counted from ``offset`` characters."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(ids, entries):
        text = texts(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else json_logprob(entry.logprob))
        out["top_logprobs"].append(None if entry is None else {texts(t): json_logprob(lp) for t, lp in entry.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def merge(first: dict | None, second: dict) -> dict:
    """Two legacy ``logprobs`` objects one after the other (an echoed prompt, then the answer)."""
    if first is None:
        return second
    return {key: first[key] + second[key] for key in first}
