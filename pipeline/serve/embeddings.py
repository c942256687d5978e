"""``POST /v1/embeddings`` (OpenAI's shape): the served model as an embedding model.

Each input is a prompt embedded by the engine's prefill-only path (``Request.pooling``: the final
hidden states pooled as ``serve.pooling`` says, last token by default, L2-normalised), all inputs
of a call submitted together so they share steps. Text is tokenized as the tokenizer does by
default (its special tokens added, no chat template), as vLLM and sentence-transformers do;
token ids are taken as they are. ``dimensions`` keeps the first N values and normalises again
(Matryoshka embeddings, as Qwen3-Embedding supports); ``encoding_format: base64`` sends the
float32 values little-endian, which the ``openai`` client decodes.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any, Callable, Literal, Union

import numpy as np
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from pydantic import Field

from pipeline.context import Request, Result
from pipeline.errors import UserError
from pipeline.memory import text_config
from pipeline.serve.bridge import Submission
from pipeline.serve.calls import admit, outcome, wait_all
from pipeline.serve.models import Target
from pipeline.serve.protocol import APIError, Body


class EmbeddingRequest(Body):
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)


def encoded(vector: list[float], dimensions: int | None, encoding: str) -> list[float] | str:
    """The embedding as sent: cut to ``dimensions`` (normalised again), floats or base64 float32."""
    values = np.asarray(vector, dtype=np.float32)
    if dimensions is not None and dimensions < len(values):
        values = values[:dimensions]
        values = values / max(float(np.linalg.norm(values)), 1e-12)
    if encoding == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode()
    return values.tolist()


class Embeddings:
    """The endpoint over the completions' pipeline (``api``: ``respond.Completions``, whose renderer
    reads the inputs and whose ledger counts the calls)."""

    def __init__(self, api: Any, pooling: str, draining: Callable[[], bool]) -> None:
        self.pipe, self.settings, self.requests, self.ledger = api.pipe, api.settings, api.requests, api.ledger
        self.gate, self.models = api.gate, api.models
        self.pooling, self.draining = pooling, draining
        self.dimensions = int(text_config(self.pipe.lm.config).hidden_size)

    def describe(self) -> dict:
        """What ``/v1/models`` says of the embeddings."""
        return {"dimensions": self.dimensions, "pooling": self.pooling, "normalized": True}

    async def create(self, body: EmbeddingRequest, http: HTTPRequest) -> JSONResponse:
        rid = "embd-" + uuid.uuid4().hex[:24]
        sub = Submission()
        try:
            target, prompts = await asyncio.to_thread(self._check, body)
            await asyncio.to_thread(self._submit, sub, rid, prompts, target)
        except UserError as err:
            sub.cancel()
            return self.ledger.refused(rid, "embeddings", APIError(400, str(err), code="invalid_value"))
        except APIError as err:
            return self.ledger.refused(rid, "embeddings", err)
        await wait_all(http, sub)
        results, err = outcome(sub.handles)
        if err is not None:
            return self.ledger.refused(rid, "embeddings", err)
        tokens = sum(r.prompt_tokens for r in results)
        self.ledger.done(rid, "embeddings", results, f"inputs={len(results)} prompt={tokens}")
        return JSONResponse(self._response(body, results, tokens, target))

    def _check(self, body: EmbeddingRequest) -> tuple[Target, list[list[int]]]:
        """The model asked for and the inputs as token ids (tokenized here: run off the event loop)."""
        target = admit(body, self.models, self.draining)
        if body.dimensions is not None and body.dimensions > self.dimensions:
            raise UserError(f"dimensions must be at most the model's {self.dimensions} (got {body.dimensions})")
        return target, [ids for ids, _ in self.requests.prompts(body.input, name="input")]

    def _submit(self, sub: Submission, rid: str, prompts: list[list[int]], target: Target) -> None:
        """All inputs queued at once (off the event loop: a submission may touch the device)."""
        with self.gate.admitting(len(prompts)):
            for i, ids in enumerate(prompts):
                request = Request(pooling=self.pooling, id=f"{rid}-{i}", adapter=target.adapter)
                sub.track(self.pipe.submit(request, ids=ids))

    def _response(self, body: EmbeddingRequest, results: list[Result], tokens: int, target: Target) -> dict:
        data = []
        for i, r in enumerate(results):
            vector = encoded(r.embedding, body.dimensions, body.encoding_format)
            data.append({"object": "embedding", "index": i, "embedding": vector})
        return {
            "object": "list",
            "data": data,
            "model": target.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
