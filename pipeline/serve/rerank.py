"""Relevance from the model, the Qwen3-Reranker way: ``POST /v1/rerank`` (Cohere's and Jina's shape,
as vLLM serves it; ``/rerank`` and ``/v2/rerank`` too) and vLLM's ``POST /score`` (``/v1/score`` too).

Each (query, document) pair becomes one judging prompt: the system message ``JUDGE``, the user turn
``<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}`` and the assistant's turn,
rendered by the model's chat template with ``enable_thinking`` false (Qwen3's template then opens
the turn with an empty think block: exactly the prompt of Qwen3-Reranker's model card; a model
without a template gets that prompt's text as is). It is prefilled only, nothing is decoded, and
the pair's score is P(yes) / (P(yes) + P(no)), the softmax over the two tokens' logits at the last
position (``judge_tokens``).

The query comes before the document, so the pairs of one request share the prompt up to the
document: they are submitted together and the engine computes the shared full KV blocks once
(the scheduler holds the others back until those blocks are in the prefix cache); ``usage``
counts the reused tokens in ``prompt_tokens_details.cached_tokens``.

A checkpoint with a sequence-classification head (``*ForSequenceClassification``) is scored by
that head instead (``ScoreHead``) on the prompt's last hidden state.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Union

import jinja2
import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from pipeline.context import Request, Result
from pipeline.engine import Handle
from pipeline.errors import UserError
from pipeline.memory import text_config
from pipeline.serve.bridge import Submission
from pipeline.serve.protocol import APIError, Body
from pipeline.serve.calls import admit, outcome, wait_all
from pipeline.serve.models import Target

# Qwen3-Reranker's judging prompt (its model card).
JUDGE = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
CARD_PREFIX = f"<|im_start|>system\n{JUDGE}<|im_end|>\n<|im_start|>user\n"  # without a chat template
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
MAX_PAIRS = 1000  # pairs (documents) per request: each is an engine sequence


# --- requests ----------------------------------------------------------------------------------


class _Body(Body):
    """What rerank and score requests share: the judging prompt's instruction."""

    instruction: str | None = None  # None: DEFAULT_INSTRUCTION


class Document(BaseModel):
    """A document given as an object (Cohere's ``{"text": ...}``); its other fields are ignored."""

    model_config = ConfigDict(extra="allow")
    text: str


class RerankRequest(_Body):
    """``POST /v1/rerank``: the documents ranked by relevance to the query, best first."""

    query: str
    documents: list[Union[str, Document]]
    top_n: int | None = None  # None: all
    return_documents: bool = True


class ScoreRequest(_Body):
    """vLLM's ``POST /score``: one score per pair, 1:1, 1:N (``text_1`` one text) or N:N."""

    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]


# --- the judging prompt and its score ------------------------------------------------------------


def user_turn(instruction: str | None, query: str, document: str) -> str:
    instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def prompt_text(owner: Any, instruction: str | None, query: str, document: str) -> str:
    """The judging prompt of one pair, rendered by ``owner``'s chat template (the model card's
    text when it has none)."""
    user = user_turn(instruction, query, document)
    if getattr(owner, "chat_template", None) is None:
        return CARD_PREFIX + user + CARD_SUFFIX
    messages = [{"role": "system", "content": JUDGE}, {"role": "user", "content": user}]
    try:
        return owner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    except jinja2.TemplateError as err:
        raise APIError(400, f"the model's chat template refused the judging prompt: {err}", code="invalid_value")


def _word_token(tokenizer: Any, word: str) -> int:
    """The token that answers ``word``: the one spelling it ("yes", else " yes"), else the first
    token of its encoding when that spells the word's beginning (a tokenizer without the word as
    one token, e.g. the tiny test models': "y" for "yes")."""
    for variant in (word, " " + word):
        ids = tokenizer.encode(variant, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids).strip() == word:
            return int(ids[0])
    ids = tokenizer.encode(word, add_special_tokens=False)
    first = tokenizer.decode(ids[:1]).strip() if ids else ""
    if first and word.startswith(first):
        return int(ids[0])
    raise APIError(
        400, f"the model's tokenizer has no token for {word!r}: it cannot judge relevance", code="unsupported_model"
    )


def judge_tokens(tokenizer: Any) -> tuple[int, int]:
    """(yes, no): the token ids whose logits score a pair (two tokens, as they spell different text)."""
    return _word_token(tokenizer, "yes"), _word_token(tokenizer, "no")


class ScoreHead:
    """A sequence-classification checkpoint's head (``score``, or ``classifier``), read from its
    files: the loader reads the model as a causal LM, which leaves the head out. A pair's score is
    the head on the judging prompt's last hidden state (the converted ``*-seq-cls`` rerankers keep
    Qwen3-Reranker's prompt): the sigmoid of a single logit, or with several labels the probability
    of label 1, the relevant class."""

    NAMES = ("score", "classifier")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight.float(), None if bias is None else bias.float()

    @classmethod
    def of(cls, lm: Any) -> "ScoreHead | None":
        """The head of ``lm``'s checkpoint when it is a sequence classifier (None otherwise)."""
        archs = [str(a) for a in getattr(lm.config, "architectures", None) or []]
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            return None
        tensors = checkpoint_tensors(lm.path, [f"{n}.{p}" for n in cls.NAMES for p in ("weight", "bias")])
        for name in cls.NAMES:
            if f"{name}.weight" in tensors:
                return cls(tensors[f"{name}.weight"], tensors.get(f"{name}.bias"))
        raise APIError(400, f"{archs[0]}: no score or classifier weights in the checkpoint", code="unsupported_model")

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores [n] from last hidden states [n, H]."""
        logits = torch.nn.functional.linear(hidden.float(), self.weight, self.bias)
        return logits[:, 0].sigmoid() if logits.shape[1] == 1 else logits.softmax(-1)[:, 1]


def checkpoint_tensors(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of ``names`` a checkpoint (a folder, or a hub id in the local cache) holds."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        folder = Path(snapshot_download(path, local_files_only=True))
    found: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            found.update({n: f.get_tensor(n) for n in names if n in f.keys()})
    return found


def relevance(pair: torch.Tensor) -> torch.Tensor:
    """P(yes) / (P(yes) + P(no)) from [..., 2] logits (no, yes)."""
    return pair.float().softmax(-1)[..., 1]


# --- the endpoints -------------------------------------------------------------------------------


class Reranker:
    """``/v1/rerank`` and ``/score`` over the completions' pipeline (``api``: ``respond.Completions``,
    whose prefill-only chain scores the pairs and whose gate and ledger admit and count the calls):
    pairs in, prefill-only sequences, scores out."""

    def __init__(self, api: Any, draining: Callable[[], bool]) -> None:
        self.pipe, self.settings, self.scorer = api.pipe, api.settings, api.scorer
        self.ledger, self.gate, self.draining = api.ledger, api.gate, draining
        self.models = api.models
        self._tokens: tuple[int, int] | None = None
        self._head: ScoreHead | None | bool = False  # False: not looked for yet

    async def rerank(self, body: RerankRequest, http: HTTPRequest) -> Response:
        rid = "rerank-" + uuid.uuid4().hex[:24]
        try:
            target = admit(body, self.models, self.draining)
            texts = [d if isinstance(d, str) else d.text for d in body.documents]
            if not texts:
                raise APIError(400, "documents: empty", code="invalid_value")
            if body.top_n is not None and body.top_n < 1:
                raise APIError(400, f"top_n must be >= 1 (got {body.top_n})", code="invalid_value")
            self._cap(len(texts), "documents")
            pairs = [(body.query, t) for t in texts]
            scores, results = await self._judge(http, rid, target, body.instruction, pairs, lambda i: f"documents[{i}]")
        except APIError as err:
            return self._failed(rid, "rerank", err)
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[: body.top_n]
        ranked = []
        for i in order:
            item: dict = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                item["document"] = {"text": texts[i]}
            ranked.append(item)
        self._done(rid, "rerank", results)
        return JSONResponse({"id": rid, "model": target.name, "usage": usage(results), "results": ranked})

    async def score(self, body: ScoreRequest, http: HTTPRequest) -> Response:
        rid = "score-" + uuid.uuid4().hex[:24]
        try:
            target = admit(body, self.models, self.draining)
            pairs = score_pairs(body.text_1, body.text_2)
            self._cap(len(pairs), "text_2")
            scores, results = await self._judge(
                http, rid, target, body.instruction, pairs, lambda i: f"text_1/text_2 pair {i}"
            )
        except APIError as err:
            return self._failed(rid, "score", err)
        self._done(rid, "score", results)
        return JSONResponse(
            {
                "id": rid,
                "object": "list",
                "created": int(time.time()),
                "model": target.name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {**usage(results), "completion_tokens": 0},
            }
        )

    # --- shared --------------------------------------------------------------------------------
    @staticmethod
    def _cap(n: int, field: str) -> None:
        if n > MAX_PAIRS:
            raise APIError(400, f"{field}: {n} pairs to score, over the limit of {MAX_PAIRS}", code="invalid_value")

    async def _judge(
        self,
        http: HTTPRequest,
        rid: str,
        target: Target,
        instruction: str | None,
        pairs: list[tuple[str, str]],
        where: Callable[[int], str],
    ) -> tuple[list[float], list[Result]]:
        """Each pair's score and result (run with ``target``'s adapter): rendered and tokenized (off
        the loop), all submitted, then waited for together."""
        prompts = await asyncio.to_thread(self._prompts, instruction, pairs, where)
        sub = Submission()
        rows: list[torch.Tensor | None] = [None] * len(prompts)
        try:
            await asyncio.to_thread(self._submit, sub, rid, prompts, rows, target.adapter)
        except UserError as err:
            sub.cancel()
            raise APIError(400, str(err), code="invalid_value") from None
        except BaseException:
            sub.cancel()  # those submitted before the failure
            raise
        await wait_all(http, sub)
        results, err = outcome(sub.handles)
        if err is not None:
            raise err
        if any(r is None for r in rows):
            raise APIError(500, "internal error (a pair ended without logits)", "server_error")
        judge = relevance if self._head is None else self._head
        scores = await asyncio.to_thread(lambda: judge(torch.stack([r.cpu() for r in rows])).tolist())
        return scores, results

    def _prompts(self, instruction: str | None, pairs: list[tuple[str, str]], where: Callable[[int], str]) -> list:
        lm = self.pipe.lm
        if self._head is False:
            self._head = ScoreHead.of(lm)
        if self._head is None and self._tokens is None:
            self._tokens = judge_tokens(lm.tokenizer)
        context = getattr(text_config(lm.config), "max_position_embeddings", None)
        out = []
        for i, (query, document) in enumerate(pairs):
            text = prompt_text(lm.template_owner, instruction, query, document)
            ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
            if context and len(ids) > context:
                raise APIError(
                    400,
                    f"{where(i)}: the judging prompt ({len(ids)} tokens) exceeds the model's context of "
                    f"{context} tokens",
                    code="context_length_exceeded",
                )
            out.append(ids)
        return out

    def _submit(self, sub: Submission, rid: str, prompts: list[list[int]], rows: list, adapter: str | None) -> None:
        """Every pair prefilled only; as each ends (on the engine's thread) its two logits (no,
        yes) are copied out of the step's logits, or with a classification head the prompt's last
        hidden state (``Request.pooling``)."""
        head = self._head is not None
        no_yes = None if head else list(reversed(self._tokens))

        def keep(i: int) -> Callable[[Handle], None]:
            def done(handle: Handle) -> None:
                ctx = handle.context
                if head and ctx.pooled is not None:
                    rows[i] = ctx.pooled
                elif not head and ctx.logits is not None:
                    rows[i] = ctx.logits.reshape(-1)[no_yes].float()

            return done

        with self.gate.admitting(len(prompts)):
            for i, ids in enumerate(prompts):
                request = Request(id=f"{rid}-{i}", max_new_tokens=0, pooling="last" if head else None, adapter=adapter)
                handle = self.scorer.submit(request, ids=ids)
                handle.add_done_callback(keep(i))
                sub.track(handle)

    def _failed(self, rid: str, endpoint: str, err: APIError) -> JSONResponse:
        return self.ledger.refused(rid, endpoint, err)

    def _done(self, rid: str, endpoint: str, results: list[Result]) -> None:
        reused = sum(int(r.metrics.get("kv_reused_tokens") or 0) for r in results)
        line = f"pairs={len(results)} prompt={sum(r.prompt_tokens for r in results)} reused={reused}"
        self.ledger.done(rid, endpoint, results, line)


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 with each text_2 (1:1, 1:N), or text_1[i] with text_2[i] (N:N)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first:
        raise APIError(400, "text_1: empty", code="invalid_value")
    if not second:
        raise APIError(400, "text_2: empty", code="invalid_value")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise APIError(
            400,
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1 (1:N) or as many as text_2 (N:N)",
            code="invalid_value",
        )
    return list(zip(first, second))


def usage(results: list[Result]) -> dict:
    """vLLM's rerank usage (every pair's prompt counted), with the tokens the prefix cache held."""
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(int(r.metrics.get("kv_reused_tokens") or 0) for r in results)
    return {"prompt_tokens": prompt, "total_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}
