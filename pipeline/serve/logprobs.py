"""Log-probabilities in OpenAI's two response shapes, from the engine's ``TokenLogprob`` entries:
chat's ``logprobs.content`` list (token, logprob, bytes, top_logprobs) and the legacy
completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset)."""

from __future__ import annotations

from typing import Sequence

from pipeline.context import TokenLogprob, json_logprob
from pipeline.engine.output import TokenTexts


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
