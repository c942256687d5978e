"""The completion endpoints: a call's sequences submitted to the engine, then answered whole or
streamed as OpenAI's chunks (usage, log-probabilities, tool calls and reasoning read off the text),
with the server's metrics counted."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pipeline.context import Result
from pipeline.errors import UserError
from pipeline.pipeline import Pipeline
from pipeline.serve import logprobs as lp
from pipeline.serve.answer import Deltas, message
from pipeline.serve.bridge import Submission
from pipeline.serve.calls import Gate, Ledger, outcome, wait_all
from pipeline.serve.prometheus import ServerMetrics
from pipeline.serve.protocol import (
    FINISH,
    APIError,
    Call,
    Sampling,
    ServeSettings,
)
from pipeline.serve.render import Renderer


class Completions:
    """``/v1/chat/completions`` and ``/v1/completions``: requests in (``Renderer``), engine sequences,
    OpenAI responses out."""

    def __init__(self, pipe: Pipeline, settings: ServeSettings, draining: Callable[[], bool]) -> None:
        self.pipe, self.settings = pipe, settings
        self.requests = Renderer(pipe, settings, draining)  # it refuses new requests while draining
        self.models = self.requests.models  # the base model and its adapters, by the names requests give
        self.metrics = ServerMetrics(pipe.engine, settings.model_name)
        self.ledger = Ledger(self.metrics)
        self.gate = Gate(pipe.engine, settings.max_waiting)
        self.texts = lp.TokenTexts(pipe.lm.tokenizer)
        self._scorer: Pipeline | None = None  # prefill only: completions with max_tokens 0 (echo)

    @property
    def scorer(self) -> Pipeline:
        """The chain without its decode stage, on the same engine: prompts scored, nothing generated."""
        if self._scorer is None:
            self._scorer = self.pipe.with_stages({k: v for k, v in self.pipe.stages.items() if k != "decode"})
        return self._scorer

    async def complete(self, body: Sampling, http: HTTPRequest, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        try:
            target, tokens = self.requests.check(body, max_tokens)
            call = await asyncio.to_thread(self.requests.call, body, chat, tokens, target)
        except UserError as err:
            return self._failed(rid, endpoint, APIError(400, str(err), code="invalid_value"))
        except APIError as err:
            return self._failed(rid, endpoint, err)
        sub = Submission()
        try:
            await asyncio.to_thread(self._submit, sub, rid, call, body.stream)
        except UserError as err:  # refused at submission (a bad output constraint): nothing else runs
            sub.cancel()
            return self._failed(rid, endpoint, APIError(400, str(err), code="invalid_value"))
        except APIError as err:  # the queue is full (serve.max_waiting): nothing was submitted
            return self._failed(rid, endpoint, err)
        meta = {"id": rid, "created": int(time.time()), "model": call.model}
        if body.stream:
            return await self._stream(body, sub, meta, chat, endpoint, call)
        return await self._whole(http, sub, meta, chat, endpoint, call)

    def _submit(self, sub: Submission, rid: str, call: Call, stream: bool) -> None:
        """Queue the choices on the engine (a prompt scored with max_tokens 0 on the prefill-only
        chain). Run off the event loop: a submission may touch the device (raw ids uploaded to
        it, a draft model's pool made on first use), which would stall every open stream for as
        long as the device is busy."""
        with self.gate.admitting(len(call.requests)):
            for i, (request, ids) in enumerate(zip(call.requests, call.ids)):
                request.id = f"{rid}-{i}"
                pipe = self.scorer if request.max_new_tokens == 0 else self.pipe
                sub.track(pipe.submit(request, on_text=sub.on_text(i) if stream else None, ids=ids))

    def _failed(self, rid: str, endpoint: str, err: APIError) -> JSONResponse:
        return self.ledger.refused(rid, endpoint, err)

    @staticmethod
    def outcome_of(sub: Submission, choice: int) -> tuple[Result | None, APIError | None]:
        """One ended choice's result, or the API error its failure maps to."""
        results, err = outcome([sub.handles[choice]])
        return (results[0] if results else None), err

    def count_done(self, rid: str, endpoint: str, results: list[Result]) -> None:
        """A call answered: its sequences' metrics counted, one line logged."""
        m = results[0].metrics
        line = (
            f"prompt={m.get('prompt_tokens')} generated={sum(len(r.token_ids) for r in results)} "
            f"ttft={m.get('ttft_s') or 0:.3f}s reused={m.get('kv_reused_tokens')}"
        )
        self.ledger.done(rid, endpoint, results, line)

    # --- answered whole ---------------------------------------------------------------------

    async def _whole(
        self, http: HTTPRequest, sub: Submission, meta: dict, chat: bool, endpoint: str, call: Call
    ) -> Response:
        await wait_all(http, sub)
        results, err = outcome(sub.handles)
        if err is not None:
            return self._failed(meta["id"], endpoint, err)
        self.count_done(meta["id"], endpoint, results)
        choice = self._chat_choice if chat else self._completion_choice
        return JSONResponse(
            {
                **meta,
                "object": "chat.completion" if chat else "text_completion",
                "choices": [choice(call, i, r) for i, r in enumerate(results)],
                "usage": usage(results, call.n),
                "metrics": reported_metrics(results[0]),
            }
        )

    def _chat_choice(self, call: Call, i: int, r: Result) -> dict:
        """A chat choice: the message read off the text (content, reasoning, tool calls)."""
        msg, finish = message(call.reading, r.text, self.requests.opened(r.prompt_ids), FINISH[r.finish_reason])
        logprobs = chat_logprobs(call, r.logprobs, self.texts)
        return {"index": i, "message": msg, "logprobs": logprobs, "finish_reason": finish}

    def _completion_choice(self, call: Call, i: int, r: Result) -> dict:
        """A completions choice: the echoed prompt first when asked (its tokens' scores too, the
        first one None), then the answer; ``finish_reason`` length when nothing was to be generated."""
        prompt = call.prompts[i] if call.echo else ""
        logprobs = None
        if call.top is not None:
            if call.echo:
                logprobs = lp.legacy(r.prompt_ids, r.prompt_logprobs or [None] * len(r.prompt_ids), self.texts)
            logprobs = lp.merge(logprobs, lp.legacy(r.token_ids, r.logprobs or [], self.texts, len(prompt)))
        finish = "length" if call.requests[i].max_new_tokens == 0 else FINISH[r.finish_reason]
        return {"index": i, "text": prompt + r.text, "logprobs": logprobs, "finish_reason": finish}

    # --- streamed ---------------------------------------------------------------------------

    async def _stream(
        self, body: Sampling, sub: Submission, meta: dict, chat: bool, endpoint: str, call: Call
    ) -> Response:
        """The answer as server-sent events, committed (200) only once its first events are known:
        a choice that failed before any text (bad media, a prompt too long) gets its JSON error."""
        try:
            first = await sub.next_events()
        except BaseException:
            sub.cancel()
            raise
        err = self._first_failure(sub, first)
        if err is not None:
            sub.cancel()
            return self._failed(meta["id"], endpoint, err)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = StreamedAnswer(self, sub, call, meta, chat, endpoint, include_usage)
        return StreamingResponse(
            stream.events(first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _first_failure(self, sub: Submission, events: list[tuple[int, str | None]]) -> APIError | None:
        """The error of the first choice these events end with a failure, if any."""
        for choice, text in events:
            if text is None:
                _, err = self.outcome_of(sub, choice)
                if err is not None:
                    return err
        return None


DONE = "data: [DONE]\n\n"  # the stream's last event


def sse(payload: dict) -> str:
    """One server-sent event: ``data:`` and the JSON, then the blank line that ends it."""
    return "data: " + json.dumps(payload) + "\n\n"


class StreamedAnswer:
    """One streamed call's events: each choice's text as it comes (a chat answer's role first,
    its deltas read off the text) with its tokens' log-probabilities, each choice's end, then
    the usage when asked and ``[DONE]``. A choice failing mid-stream ends it with an error event."""

    def __init__(
        self,
        api: Completions,
        sub: Submission,
        call: Call,
        meta: dict,
        chat: bool,
        endpoint: str,
        include_usage: bool,
    ) -> None:
        self.api, self.sub, self.call, self.meta, self.chat = api, sub, call, meta, chat
        self.endpoint, self.include_usage = endpoint, include_usage
        self.object = "chat.completion.chunk" if chat else "text_completion"
        n = len(sub.handles)
        self.sent = [0] * n  # per choice: log-probabilities sent so far
        self.offsets = [0] * n  # per choice: characters sent so far (text_offset)
        self.deltas: list[Deltas | None] = [None] * n  # per choice (chat): what its text added
        self.finished: list[Result | None] = [None] * n
        self.failed = False

    async def events(self, first: list[tuple[int, str | None]]) -> AsyncIterator[str]:
        """The events, from the submission's first ones on, until ``[DONE]``."""
        try:
            if self.chat:  # each choice's role first
                for choice in range(len(self.sub.handles)):
                    yield self.role_chunk(choice)
            pending = first
            while True:
                for choice, text in pending:
                    for event in self._events_of(choice, text):
                        yield event
                    if self.failed:
                        return
                if not self.sub.open:
                    break
                pending = await self.sub.next_events()
            for event in self._closing():
                yield event
        finally:
            self.sub.cancel()  # client gone mid-stream (or done): nothing keeps running for it

    def _events_of(self, choice: int, text: str | None) -> list[str]:
        """What one submission event sends: a chunk of new text (none while a chat answer holds
        it back), or the choice's end."""
        if text is None:
            return self._ended(choice)
        chunk = self.chunk(choice, text)
        return [chunk] if chunk else []

    def _ended(self, choice: int) -> list[str]:
        """A choice ended: what its chat answer held back, then its ``finish_reason``; or, when it
        failed, the error and ``[DONE]`` (the stream ends there)."""
        result, err = self.api.outcome_of(self.sub, choice)
        if err is not None:
            self.failed = True
            self.api.ledger.failed(self.meta["id"], self.endpoint, err, " (streaming)")
            return [sse({"error": {"message": err.message, "type": err.type, "code": err.code}}), DONE]
        self.finished[choice] = result
        rest = self.deltas[choice].flush() if self.deltas[choice] is not None else None
        held = [self._event({"index": choice, "delta": rest, "logprobs": None, "finish_reason": None})] if rest else []
        return held + [self.chunk(choice, finish=FINISH[result.finish_reason])]

    def _closing(self) -> list[str]:
        """After every choice ended: the call counted and logged, its usage when asked, ``[DONE]``."""
        results = [r for r in self.finished if r is not None]
        self.api.count_done(self.meta["id"], self.endpoint, results)
        if not self.include_usage:
            return [DONE]
        totals = {"usage": usage(results, self.call.n), "metrics": reported_metrics(results[0])}
        return [sse({**self.meta, "object": self.object, "choices": [], **totals}), DONE]

    def _event(self, item: dict) -> str:
        """A chunk of one choice: ``item`` under the call's id, time and model."""
        return sse({**self.meta, "object": self.object, "choices": [item]})

    def role_chunk(self, choice: int) -> str:
        """A chat choice's first chunk: the assistant's role, no text yet."""
        delta = {"role": "assistant", "content": ""}
        return self._event({"index": choice, "delta": delta, "logprobs": None, "finish_reason": None})

    def chunk(self, choice: int, text: str | None = None, finish: str | None = None) -> str:
        """A chunk of new ``text`` (None: the choice's end, with ``finish``) and the log-probabilities
        of the tokens since the last one; empty when a chat answer holds the text back."""
        logprobs = self._scores(choice, text)
        if not self.chat:
            return self._event({"index": choice, "text": text or "", "logprobs": logprobs, "finish_reason": finish})
        delta = {} if text is None else self._chat_delta(choice, text)
        if text is not None and not delta and logprobs is None:
            return ""  # held back (it may be a tool call starting)
        deltas = self.deltas[choice]
        if finish == "stop" and deltas is not None and deltas.called:
            finish = "tool_calls"
        return self._event({"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": finish})

    def _chat_delta(self, choice: int, text: str) -> dict:
        """What ``text`` adds to a chat answer: content, reasoning, tool-call fragments."""
        if self.deltas[choice] is None:
            opened = self.api.requests.opened(self.sub.handles[choice].context.input_ids)
            self.deltas[choice] = Deltas(self.call.reading, opened)
        return self.deltas[choice].add(text)

    def _scores(self, choice: int, text: str | None) -> dict | None:
        """The log-probabilities of the tokens this choice generated since its last chunk."""
        if self.call.top is None:
            return None
        entries = self.sub.handles[choice].context.logprobs[self.sent[choice] :]
        self.sent[choice] += len(entries)
        if self.chat:
            return chat_logprobs(self.call, entries, self.api.texts)
        out = lp.legacy([e.token_id for e in entries], entries, self.api.texts, self.offsets[choice])
        self.offsets[choice] += len(text or "")
        return out


# --- the parts of a response both ways share ---------------------------------------------------


def usage(results: list[Result], n: int) -> dict:
    """Each prompt counted once (its ``n`` choices share it); ``cached_tokens``: its tokens the
    prefix cache held."""
    firsts = results[::n]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(len(r.token_ids) for r in results)
    cached = sum(int(r.metrics.get("kv_reused_tokens") or 0) for r in firsts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


REPORTED_METRICS = (
    "ttft_s",
    "tpot_s",
    "decode_tok_s",
    "prefill_tok_s",
    "queue_s",
    "prompt_tokens",
    "kv_reused_tokens",
    "prefill_tokens",
    "generated_tokens",
    "total_s",
)


def reported_metrics(result: Result) -> dict:
    """The metrics a response carries (``metrics``, next to ``usage``): the first choice's."""
    return {k: result.metrics.get(k) for k in REPORTED_METRICS}


def chat_logprobs(call: Call, entries: Any, texts: lp.TokenTexts) -> dict | None:
    """A chat choice's ``logprobs`` (None when not asked)."""
    return None if call.top is None else {"content": lp.chat_content(entries or [], texts), "refusal": None}
