"""The completion endpoints: a call's sequences submitted to the engine, then answered whole or
streamed as OpenAI's chunks (usage, log-probabilities, tool calls and reasoning read off the text),
with the server's metrics counted."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pipeline.context import Result
from pipeline.engine import Cancelled, Handle
from pipeline.errors import UserError
from pipeline.pipeline import Pipeline
from pipeline.serve import logprobs as lp
from pipeline.serve.answer import Deltas, message
from pipeline.serve.bridge import Submission
from pipeline.serve.prometheus import ServerMetrics
from pipeline.serve.protocol import (
    FINISH,
    APIError,
    Call,
    Sampling,
    ServeSettings,
    error_response,
)
from pipeline.serve.render import Renderer


def log(line: str) -> None:
    """One line of the server's log, on stderr (stdout is not the server's)."""
    print(line, file=sys.stderr, flush=True)


class Completions:
    """``/v1/chat/completions`` and ``/v1/completions``: requests in (``Renderer``), engine sequences,
    OpenAI responses out."""

    def __init__(self, pipe: Pipeline, settings: ServeSettings, draining: Callable[[], bool]) -> None:
        self.pipe, self.settings = pipe, settings
        self.requests = Renderer(pipe, settings, draining)  # it refuses new requests while draining
        self.metrics = ServerMetrics(pipe.engine)
        self.started = int(time.time())
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
            tokens = self.requests.check(body, max_tokens)
            call = await asyncio.to_thread(self.requests.call, body, chat, tokens)
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
        meta = {"id": rid, "created": int(time.time()), "model": self.settings.model_name}
        if body.stream:
            return await self._stream(body, http, sub, meta, chat, endpoint, call)
        return await self._whole(http, sub, meta, chat, endpoint, call)

    def _submit(self, sub: Submission, rid: str, call: Call, stream: bool) -> None:
        """Queue the choices on the engine (a prompt scored with max_tokens 0 on the prefill-only
        chain). Run off the event loop: a submission may touch the device (raw ids uploaded to
        it, a draft model's pool made on first use), which would stall every open stream for as
        long as the device is busy."""
        for i, (request, ids) in enumerate(zip(call.requests, call.ids)):
            request.id = f"{rid}-{i}"
            pipe = self.scorer if request.max_new_tokens == 0 else self.pipe
            sub.track(pipe.submit(request, on_text=sub.on_text(i) if stream else None, ids=ids))

    def _failed(self, rid: str, endpoint: str, err: APIError) -> JSONResponse:
        self.metrics.requests.labels(endpoint, str(err.status)).inc()
        log(f"{rid} {err.status} {err.message}")
        return error_response(err.status, err.message, err.type, err.code)

    def _outcome(self, handles: list[Handle]) -> tuple[list[Result] | None, APIError | None]:
        """The finished handles' results, or the API error their first failure maps to."""
        try:
            return [handle.result() for handle in handles], None
        except UserError as err:
            return None, APIError(400, str(err), code="invalid_value")
        except Cancelled:
            return None, APIError(499, "cancelled", "cancelled")
        except Exception as err:  # a failed forward: reported, never a traceback to the client
            traceback.print_exception(err, file=sys.stderr)
            return None, APIError(500, f"internal error ({type(err).__name__}: {err})", "server_error")

    def _done(self, rid: str, endpoint: str, results: list[Result]) -> None:
        for result in results:
            self.metrics.finished(result.metrics)
        self.metrics.requests.labels(endpoint, "200").inc()
        m = results[0].metrics
        log(
            f"{rid} 200 prompt={m.get('prompt_tokens')} generated={sum(len(r.token_ids) for r in results)} "
            f"ttft={m.get('ttft_s') or 0:.3f}s reused={m.get('kv_reused_tokens')}"
        )

    @staticmethod
    def _usage(results: list[Result], n: int) -> dict:
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

    @staticmethod
    def _metrics(result: Result) -> dict:
        keys = (
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
        return {k: result.metrics.get(k) for k in keys}

    async def _whole(
        self, http: HTTPRequest, sub: Submission, meta: dict, chat: bool, endpoint: str, call: Call
    ) -> Response:
        async def watch() -> None:  # a client that hangs up cancels its sequences
            while not await http.is_disconnected():
                await asyncio.sleep(0.25)
            sub.cancel()

        watcher = asyncio.create_task(watch())
        try:
            while sub.open:
                await sub.next_events()
        finally:
            watcher.cancel()
            sub.cancel()
        results, err = self._outcome(sub.handles)
        if err is not None:
            return self._failed(meta["id"], endpoint, err)
        self._done(meta["id"], endpoint, results)
        if chat:
            choices = []
            for i, r in enumerate(results):
                msg, finish = message(call.reading, r.text, self.requests.opened(r.prompt_ids), FINISH[r.finish_reason])
                choices.append(
                    {
                        "index": i,
                        "message": msg,
                        "logprobs": self._chat_logprobs(call, r.logprobs),
                        "finish_reason": finish,
                    }
                )
        else:
            choices = [self._completion_choice(call, i, r) for i, r in enumerate(results)]
        return JSONResponse(
            {
                **meta,
                "object": "chat.completion" if chat else "text_completion",
                "choices": choices,
                "usage": self._usage(results, call.n),
                "metrics": self._metrics(results[0]),
            }
        )

    def _chat_logprobs(self, call: Call, entries: Any) -> dict | None:
        return None if call.top is None else {"content": lp.chat_content(entries or [], self.texts), "refusal": None}

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

    async def _stream(
        self, body: Sampling, http: HTTPRequest, sub: Submission, meta: dict, chat: bool, endpoint: str, call: Call
    ) -> Response:
        try:
            first = await sub.next_events()  # commit to 200 only once something is known
        except BaseException:
            sub.cancel()
            raise
        for choice, text in first:
            if text is None:
                _, err = self._outcome_of(sub, choice)
                if err is not None:
                    sub.cancel()
                    return self._failed(meta["id"], endpoint, err)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = [0] * len(sub.handles)  # per choice: log-probabilities sent so far
        deltas: list[Deltas | None] = [None] * len(sub.handles)  # per choice (chat): what its text added
        offsets = [0] * len(sub.handles)  # per choice: characters sent so far (text_offset)

        def scores(choice: int, text: str | None) -> dict | None:
            """The log-probabilities of the tokens this choice generated since its last chunk."""
            if call.top is None:
                return None
            entries = sub.handles[choice].context.logprobs[sent[choice] :]
            sent[choice] += len(entries)
            if chat:
                return self._chat_logprobs(call, entries)
            out = lp.legacy([e.token_id for e in entries], entries, self.texts, offsets[choice])
            offsets[choice] += len(text or "")
            return out

        def chunk(
            choice: int,
            text: str | None = None,
            finish: str | None = None,
            role: bool = False,
            held: dict | None = None,
        ) -> str:
            """A chunk of ``text`` (or ``held``: the delta of what a chat answer held back, sent as it is)."""
            if held is not None:
                return (
                    "data: "
                    + json.dumps(
                        {
                            **meta,
                            "object": obj,
                            "choices": [{"index": choice, "delta": held, "logprobs": None, "finish_reason": None}],
                        }
                    )
                    + "\n\n"
                )
            logprobs = None if role else scores(choice, text)
            if chat:
                delta: dict = {"role": "assistant", "content": ""} if role else {}
                if text is not None:
                    if deltas[choice] is None:
                        deltas[choice] = Deltas(
                            call.reading, self.requests.opened(sub.handles[choice].context.input_ids)
                        )
                    delta = deltas[choice].add(text)
                    if not delta and logprobs is None:
                        return ""  # held back (it may be a tool call starting)
                if finish == "stop" and deltas[choice] is not None and deltas[choice].called:
                    finish = "tool_calls"
                item = {"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                item = {"index": choice, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            return "data: " + json.dumps({**meta, "object": obj, "choices": [item]}) + "\n\n"

        async def lines() -> AsyncIterator[str]:
            finished: list[Result | None] = [None] * len(sub.handles)
            try:
                if chat:
                    for i in range(len(sub.handles)):
                        yield chunk(i, role=True)
                pending = first
                while True:
                    for choice, text in pending:
                        if text is not None:
                            piece = chunk(choice, text)
                            if piece:
                                yield piece
                            continue
                        result, err = self._outcome_of(sub, choice)
                        if err is not None:
                            self.metrics.requests.labels(endpoint, str(err.status)).inc()
                            log(f"{meta['id']} {err.status} (streaming) {err.message}")
                            yield (
                                "data: "
                                + json.dumps({"error": {"message": err.message, "type": err.type, "code": err.code}})
                                + "\n\n"
                            )
                            yield "data: [DONE]\n\n"
                            return
                        finished[choice] = result
                        rest = deltas[choice].flush() if deltas[choice] is not None else None
                        if rest:
                            yield chunk(choice, held=rest)
                        yield chunk(choice, finish=FINISH[result.finish_reason])
                    if not sub.open:
                        break
                    pending = await sub.next_events()
                results = [r for r in finished if r is not None]
                self._done(meta["id"], endpoint, results)
                if include_usage:
                    usage = self._usage(results, call.n)
                    yield (
                        "data: "
                        + json.dumps(
                            {**meta, "object": obj, "choices": [], "usage": usage, "metrics": self._metrics(results[0])}
                        )
                        + "\n\n"
                    )
                yield "data: [DONE]\n\n"
            finally:
                sub.cancel()  # client gone mid-stream (or done): nothing keeps running for it

        return StreamingResponse(
            lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    def _outcome_of(self, sub: Submission, choice: int) -> tuple[Result | None, APIError | None]:
        results, err = self._outcome([sub.handles[choice]])
        return (results[0] if results else None), err
