"""``POST /v1/audio/transcriptions`` (OpenAI's shape): the served audio model transcribes a clip.

A multipart form: ``file`` (the audio: decoded and limited as ``input_audio`` parts are),
``model``, ``language`` (ISO-639-1), ``prompt``, ``response_format`` (``json``: ``{"text"}``,
``text``: the text alone, ``verbose_json``: one segment over the whole clip, the models served
giving no timestamps) and ``temperature``. Any other field is a 400 naming it.

The clip is asked about the way its model's card transcribes (``PROMPTS``, keyed by the config's
``model_type``; other audio-capable models get the generic instruction ``GENERIC``), as one
request through the served pipeline, so the answer is the one ``mode=run`` or a chat completion
gives for that prompt. A base checkpoint whose chat template does not render audio (Qwen2-Audio-7B)
gets the raw task prompt of its card instead, rendered without a template (``RawPrompt``).
"""

from __future__ import annotations

import asyncio
import functools
import re
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import Field, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from pipeline.context import Context, Request, Result
from pipeline.errors import UserError
from pipeline.pipeline import Pipeline
from pipeline.serve.bridge import Submission
from pipeline.serve.calls import admit, outcome, wait_all
from pipeline.serve.media import audio_from_bytes
from pipeline.serve.models import Target
from pipeline.serve.protocol import APIError, Body, Sampling
from stages.tokenize import Tokenize

FORMATS = ("json", "text", "verbose_json")
MAX_PROMPT_TOKENS = 224  # OpenAI's limit on a transcription prompt (Whisper's context half)
QWEN2_AUDIO_SLOT = "<|audio_bos|><|AUDIO|><|audio_eos|>"


@dataclass(frozen=True)
class AsrPrompt:
    """How a model is asked to transcribe: ``instruction`` after the clip in the user's turn
    (``{language}``: `` English`` when the request names a language, else nothing), under an
    optional ``system`` message; ``raw``: the card's prompt for a base checkpoint (no chat
    template that renders audio), written out whole with the clip's placeholder (``{tag}``:
    `` <|en|>``, the language token, when a language is named)."""

    instruction: str
    system: str | None = None
    raw: str | None = None


# Qwen2-Audio: the Instruct model is asked in a chat turn; the base model's card and its ASR
# evaluation (QwenLM/Qwen2-Audio eval_audio) prompt "Detect the language and recognize the speech: <|en|>".
# Qwen2.5-Omni: the cookbook's speech recognition (universal_audio_understanding), system prompt included.
_OMNI = AsrPrompt(
    "Transcribe the{language} audio into text without any punctuation marks.",
    system="You are a speech recognition model.",
)
PROMPTS: dict[str, AsrPrompt] = {
    "qwen2_audio": AsrPrompt(
        "Transcribe the{language} audio into text.",
        raw=QWEN2_AUDIO_SLOT + "Detect the language and recognize the speech:{tag}",
    ),
    "qwen2_5_omni": _OMNI,
    "qwen2_5_omni_thinker": _OMNI,
}
GENERIC = AsrPrompt("Transcribe the{language} audio into text.")
LANGUAGE_TAG = re.compile(r"^\s*<\|([a-z]{2,3})\|>\s*")  # what a base Qwen2-Audio answers first


class TranscriptionForm(Body):
    """The form's fields other than ``file`` (OpenAI's; its other fields are refused by name)."""

    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float | None = Field(default=None, ge=0, le=1)


@dataclass
class Ask:
    """One transcription: its engine request, whether it goes without a chat template, and what
    the response needs."""

    request: Request
    raw: bool
    form: TranscriptionForm
    duration: float
    language: str | None  # the ISO-639-1 code asked for


def asr_prompt(lm: Any) -> AsrPrompt:
    """The model's way to be asked for a transcription (``PROMPTS`` by model type, else ``GENERIC``)."""
    return PROMPTS.get(str(getattr(lm.config, "model_type", "")), GENERIC)


def renders_audio(lm: Any) -> bool:
    """Whether the model's chat template places audio (an Instruct model's does; a base one's,
    when it has any, is text only)."""
    template = getattr(lm.template_owner, "chat_template", None)
    return "audio" in str(template or "").lower()


class RawPrompt(Tokenize):
    """Tokenize for a prompt written out whole, its clip's placeholder in it (``Request.prompt``):
    no chat template, as a base checkpoint's card feeds its processor. A clip longer than the
    encoder's window is split by the family as usual; its placeholder is then repeated, once a piece."""

    def __call__(self, ctx: Context) -> Context:
        lm = ctx.lm
        req = ctx.request = lm.family.prepare(lm, ctx.request, long_audio=self.long_audio)
        text = str(req.prompt).replace(QWEN2_AUDIO_SLOT, QWEN2_AUDIO_SLOT * len(req.audios), 1)
        inputs = dict(lm.family.process(lm, text, req))
        inputs.pop("attention_mask", None)
        ctx.input_ids = inputs.pop("input_ids").to(lm.device)
        ctx.model_inputs = inputs
        ctx.extras["prompt_text"] = text
        ctx.token_keys = lm.family.token_keys(ctx)
        return ctx


def read_form(items: list[tuple[str, Any]]) -> tuple[TranscriptionForm, Any]:
    """The form's fields (``name[]`` read as ``name``: how clients send lists) and its ``file``."""
    fields: dict[str, Any] = {}
    for name, value in items:
        name = name.removesuffix("[]")
        if name in fields:
            fields[name] = [*fields[name], value] if isinstance(fields[name], list) else [fields[name], value]
        else:
            fields[name] = value
    upload = fields.pop("file", None)
    try:
        form = TranscriptionForm(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "form"
        raise APIError(400, f"{where}: {first.get('msg', 'invalid value')}", code="invalid_value") from None
    return form, upload


def compression_ratio(text: str) -> float:
    """Whisper's repetition check: the text's bytes over their zlib-compressed size."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


class Transcriptions:
    """The endpoint over the completions' pipeline (``api``: ``respond.Completions``: its renderer's
    sampler, its gate (``serve.max_waiting``), its ledger)."""

    def __init__(self, api: Any, draining: Callable[[], bool]) -> None:
        self.pipe, self.settings, self.requests, self.ledger = api.pipe, api.settings, api.requests, api.ledger
        self.gate, self.draining, self.models = api.gate, draining, api.models

    @functools.cached_property
    def raw_pipe(self) -> Pipeline:
        """The served chain with ``RawPrompt`` for its tokenizer, on the same engine (base checkpoints)."""
        tokenize = self.pipe.stages.get("tokenize")
        raw = RawPrompt(long_audio=getattr(tokenize, "long_audio", "split"))
        return self.pipe.with_stages({**self.pipe.stages, "tokenize": raw})

    async def create(self, http: HTTPRequest) -> Response:
        rid = "trsc-" + uuid.uuid4().hex[:24]
        fields = None
        try:
            try:
                fields = await http.form(max_files=4, max_fields=64)
            except HTTPException as err:  # Starlette's multipart errors (too many parts, a malformed body)
                raise APIError(400, f"the request body is not a valid multipart form: {err.detail}") from None
            form, upload = read_form(list(fields.multi_items()))
            target = self._check(form, upload)
            data = await upload.read()
            ask = await asyncio.to_thread(self._ask, form, data, target)
        except UserError as err:
            return self.ledger.refused(rid, "transcriptions", APIError(400, str(err), code="invalid_value"))
        except APIError as err:
            return self.ledger.refused(rid, "transcriptions", err)
        finally:
            if fields is not None:
                await fields.close()  # the upload's spooled file
        sub = Submission()
        try:
            await asyncio.to_thread(self._submit, sub, rid, ask)
        except UserError as err:
            sub.cancel()
            return self.ledger.refused(rid, "transcriptions", APIError(400, str(err), code="invalid_value"))
        except APIError as err:  # the queue is full (serve.max_waiting): nothing was submitted
            return self.ledger.refused(rid, "transcriptions", err)
        await wait_all(http, sub)
        results, err = outcome(sub.handles)
        if err is not None:
            return self.ledger.refused(rid, "transcriptions", err)
        r = results[0]
        line = (
            f"audio={ask.duration:.2f}s language={ask.language or '-'} prompt={r.prompt_tokens} "
            f"generated={len(r.token_ids)}"
        )
        self.ledger.done(rid, "transcriptions", results, line)
        return self._response(ask, r)

    def _check(self, form: TranscriptionForm, upload: Any) -> Target:
        """Refusals before the audio is read: the call's fields, the format, the file, the model;
        else the model asked for."""
        target = admit(form, self.models, self.draining)
        if form.response_format not in FORMATS:
            raise APIError(
                400,
                f"response_format {form.response_format!r}: not supported (json, text or verbose_json; "
                "srt and vtt need timestamps, which the audio models served do not give)",
                code="unsupported_parameter",
            )
        if upload is None:
            raise APIError(400, "file: missing (the audio to transcribe, as a multipart file upload)")
        if not isinstance(upload, UploadFile):  # a text field, or several files
            raise APIError(400, "file: give one audio file, as a multipart file upload")
        lm = self.pipe.lm
        if "audio" not in lm.family.media:  # the words chat completions use for an audio part
            raise UserError(f"file: {lm.path} is a {lm.family.name} model without an audio encoder")
        return target

    def _ask(self, form: TranscriptionForm, data: bytes, target: Target) -> Ask:
        """The engine request for this clip, run with ``target``'s adapter (off the loop: decoding
        and tokenizing are CPU work)."""
        lm = self.pipe.lm
        card = asr_prompt(lm)
        use_raw = card.raw is not None and not renders_audio(lm)
        code = self._language(form.language, lm, use_raw)
        name = LANGUAGES[code].title() if code else None
        context = (form.prompt or "").strip()
        if context and use_raw:
            raise UserError(
                f"prompt: not supported by {lm.path}: a base checkpoint is asked with its card's fixed task prompt"
            )
        if context:
            n = len(lm.tokenizer(context, add_special_tokens=False)["input_ids"])
            if n > MAX_PROMPT_TOKENS:
                raise UserError(f"prompt: {n} tokens, over the {MAX_PROMPT_TOKENS} a transcription prompt may have")
        wave, rate = audio_from_bytes(data, "file", lm.family.audio_rate(lm), self.settings.media)
        if use_raw:
            text = card.raw.format(tag=f" <|{code}|>" if code else "")
        else:
            text = card.instruction.format(language=f" {name}" if name else "")
            if context:
                text += f"\nContext: {context}"
        request = Request(
            prompt=text,
            audios=[(wave, rate)],
            system_prompt=None if use_raw else card.system,
            max_new_tokens=self.settings.default_max_tokens,
            sampler=self.requests.sampler(Sampling(temperature=form.temperature), 0),
            logprobs=0 if form.response_format == "verbose_json" else None,
            adapter=target.adapter,
        )
        return Ask(request, use_raw, form, wave.numel() / rate, code)

    @staticmethod
    def _language(language: str | None, lm: Any, raw: bool) -> str | None:
        """The ISO-639-1 code asked for (None: not given); a base checkpoint needs its token."""
        if language is None or not language.strip():
            return None
        code = language.strip().lower()
        if code not in LANGUAGES:
            raise UserError(f"language: {language!r} is not an ISO-639-1 code (en, fr, zh, ...)")
        if raw and f"<|{code}|>" not in lm.tokenizer.get_vocab():
            raise UserError(f"language: {lm.path} has no <|{code}|> language token")
        return code

    def _submit(self, sub: Submission, rid: str, ask: Ask) -> None:
        """Queued on the engine (off the loop: a submission may touch the device)."""
        ask.request.id = f"{rid}-0"
        with self.gate.admitting(1):
            sub.track((self.raw_pipe if ask.raw else self.pipe).submit(ask.request))

    @staticmethod
    def _response(ask: Ask, r: Result) -> Response:
        text, code = r.text, ask.language
        if ask.raw:  # a base checkpoint names the language it detected first
            tag = LANGUAGE_TAG.match(text)
            if tag is not None:
                text, code = text[tag.end() :], code or (tag.group(1) if tag.group(1) in LANGUAGES else None)
        fmt = ask.form.response_format
        if fmt == "text":
            return PlainTextResponse(text)
        if fmt == "json":
            tokens = {"input_tokens": r.prompt_tokens, "output_tokens": len(r.token_ids)}
            usage = {"type": "tokens", **tokens, "total_tokens": sum(tokens.values())}
            return JSONResponse({"text": text, "usage": usage})
        scores = [t.logprob for t in r.logprobs or []]
        segment = {
            "id": 0,
            "seek": 0,
            "start": 0.0,
            "end": round(ask.duration, 3),
            "text": text,
            "tokens": r.token_ids,
            "temperature": float(getattr(ask.request.sampler, "temperature", 0.0)),
            "avg_logprob": sum(scores) / len(scores) if scores else 0.0,
            "compression_ratio": compression_ratio(text),
            "no_speech_prob": 0.0,  # not computed: the models served have no no-speech token
        }
        return JSONResponse(
            {
                "task": "transcribe",
                "language": LANGUAGES[code] if code else "unknown",
                "duration": round(ask.duration, 3),
                "text": text,
                "segments": [segment],
                "usage": {"type": "duration", "seconds": round(ask.duration, 3)},
            }
        )
