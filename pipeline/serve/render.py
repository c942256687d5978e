"""HTTP bodies read into engine requests: the checks, the chat messages rendered with their media,
the sampler a request asks for, output constraints and tools, raw completion prompts; and the
tokenizer endpoints. Runs off the event loop (media decoding and tokenizing are CPU work)."""

from __future__ import annotations

from typing import Any, Callable

from pipeline.context import Request
from pipeline.errors import UserError
from pipeline.memory import text_config
from pipeline.pipeline import Pipeline
from pipeline.runner.grammar import inside_think, think_ids
from pipeline.serve.answer import Reading
from pipeline.serve.calls import admit
from pipeline.serve.media import audio_from_base64, audio_from_url, image_from_url, video_from_url
from pipeline.serve.models import Models, Target
from pipeline.serve.protocol import (
    RESERVED_TEMPLATE_KWARGS,
    APIError,
    AudioPart,
    AudioURLPart,
    Call,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ImagePart,
    Sampling,
    ServeSettings,
    TextPart,
    TokenizeRequest,
    VideoPart,
)
from pipeline.structured.response_format import from_response_format, from_structured_outputs
from pipeline.structured.tools import call_grammar, check_tools, tool_format
from stages.sampler import Sampler


class Renderer:
    """Reads OpenAI request bodies for one pipeline (``Completions`` asks it; the tokenizer routes too)."""

    def __init__(self, pipe: Pipeline, settings: ServeSettings, draining: Callable[[], bool]) -> None:
        self.pipe, self.settings, self.draining = pipe, settings, draining
        self.models = Models(pipe, settings)  # what a request's model names
        self.think_ids = think_ids(pipe.lm.tokenizer)

    def check(self, body: Sampling, max_tokens: int | None) -> tuple[Target, int]:
        """The call's target (base model or adapter) and its max_tokens, or the refusal."""
        s = self.settings
        target = admit(body, self.models, self.draining)
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", code="invalid_value")
        if isinstance(body, CompletionRequest) and max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens=0 returns nothing without echo: true", code="invalid_value")
        if isinstance(body, CompletionRequest) and body.echo and body.stream:
            raise APIError(400, "echo with stream is not supported: ask without stream", code="invalid_value")
        if body.n > s.max_n:
            raise APIError(400, f"n={body.n} is over serve.max_n ({s.max_n})", code="invalid_value")
        tokens = max_tokens if max_tokens is not None else s.default_max_tokens
        if tokens > s.max_tokens:
            raise APIError(400, f"max_tokens={tokens} is over serve.max_tokens ({s.max_tokens})", code="invalid_value")
        return target, tokens

    def sampler(self, body: Sampling, choice: int) -> Any:
        """The server's sampler settings, overridden by the request's temperature / top_p / seed
        (choice ``i`` of ``n`` seeded with seed + i, so the choices differ and each reproduces)."""
        base = getattr(self.pipe.stages.get("decode"), "sampler", None)
        names = (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "seed",
        )
        settings = {k: getattr(base, k) for k in names} if isinstance(base, Sampler) else {}
        for name in names:
            value = getattr(body, name)
            if value is not None:
                settings[name] = max(value, 0) if name == "top_k" else value  # vLLM's -1: off
        if settings.get("seed") is not None:
            settings["seed"] += choice
        try:
            return Sampler(**settings)
        except ValueError as err:
            raise APIError(400, str(err), code="invalid_value") from None

    def messages(self, body: ChatCompletionRequest) -> tuple[list[dict], list, list, list]:
        """OpenAI messages -> chat-template messages with media placeholders, images, audios, videos."""
        lm, policy = self.pipe.lm, self.settings.media
        if not body.messages:
            raise UserError("messages is empty")
        family = lm.family
        messages: list[dict] = []
        images: list = []
        audios: list = []
        videos: list = []
        for m, msg in enumerate(body.messages):
            role = "system" if msg.role == "developer" else msg.role
            content = msg.content or ""
            calls = {"tool_calls": [c.model_dump(exclude_none=True) for c in msg.tool_calls]} if msg.tool_calls else {}
            if msg.role == "tool":
                calls = {"tool_call_id": msg.tool_call_id or ""}
            if isinstance(content, str):
                if role == "user" and family.media:
                    content = family.content(content, 0, 0)  # as mode=run renders a text prompt
                messages.append({"role": role, "content": content, **calls})
                continue
            parts: list[dict] = []
            for p, part in enumerate(content):
                where = f"messages[{m}].content[{p}]"
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": part.text})
                    continue
                kind = "image" if isinstance(part, ImagePart) else "video" if isinstance(part, VideoPart) else "audio"
                if kind not in family.media:
                    article = "an" if kind[0] in "aeiou" else "a"
                    raise UserError(f"{where}: {lm.path} is a {family.name} model without {article} {kind} encoder")
                if isinstance(part, ImagePart):
                    if len(images) >= policy.max_images:
                        raise UserError(f"{where}: more than serve.max_images ({policy.max_images}) images")
                    images.append(image_from_url(part.image_url.url, where, policy))
                    parts.append({"type": "image"})
                elif isinstance(part, VideoPart):
                    if len(videos) >= policy.max_videos:
                        raise UserError(f"{where}: more than serve.max_videos ({policy.max_videos}) videos")
                    videos.append(video_from_url(part.video_url.url, where, policy))
                    parts.append({"type": "video"})
                elif isinstance(part, (AudioPart, AudioURLPart)):
                    if len(audios) >= policy.max_audios:
                        raise UserError(f"{where}: more than serve.max_audios ({policy.max_audios}) audio clips")
                    rate = family.audio_rate(lm)
                    if isinstance(part, AudioURLPart):  # vLLM's extension: the URL rules of image_url
                        audios.append(audio_from_url(part.audio_url.url, where, rate, policy))
                    else:
                        audios.append(audio_from_base64(part.input_audio.data, where, rate, policy))
                    parts.append({"type": "audio", "audio": f"audio {len(audios)}"})
            if not family.media:  # text models' templates take a string
                content = "".join(part["text"] for part in parts)
            else:
                content = parts
            messages.append({"role": role, "content": content, **calls})
        return messages, images, audios, videos

    def call(self, body: Sampling, chat: bool, tokens: int, target: Target) -> Call:
        """One Request per choice of each prompt (completions: with its raw prompt ids), run with
        ``target``'s adapter. Runs off the loop: media decoding and tokenizing are CPU work."""
        common = dict(
            max_new_tokens=tokens,
            ignore_eos=body.ignore_eos,
            stop=body.stops(),
            stop_token_ids=list(body.stop_token_ids or []),
            min_new_tokens=body.min_tokens,
            priority=body.priority,
            adapter=target.adapter,
        )
        if chat:
            assert isinstance(body, ChatCompletionRequest)
            messages, images, audios, videos = self.messages(body)
            kwargs = dict(body.chat_template_kwargs or {})
            reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
            if reserved:
                raise UserError(f"chat_template_kwargs: {reserved[0]!r} is set by the server (tools go in tools)")
            thinking, kwargs = self.reasoning(body.reasoning_effort, kwargs)
            reading, constraint = self.tools(body)
            common.update(
                messages=messages,
                images=images,
                audios=audios,
                videos=videos,
                chat_template_kwargs=kwargs or None,
                thinking=None if thinking is None else bool(thinking),
                tools=body.tools,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                **constraint,
            )
            top = (body.top_logprobs or 0) if body.logprobs else None
            requests = [Request(**common, sampler=self.sampler(body, i), logprobs=top) for i in range(body.n)]
            return Call(requests, [None] * body.n, [""] * body.n, body.n, top=top, reading=reading, model=target.name)
        assert isinstance(body, CompletionRequest)
        common.update(self.constraint(body))
        prompts = self.prompts(body.prompt)
        top, echo = body.logprobs, body.echo
        call = Call([], [], [], body.n, echo, top, model=target.name)
        for ids, text in prompts:
            for i in range(body.n):
                call.requests.append(
                    Request(
                        **common, sampler=self.sampler(body, i), logprobs=top, prompt_logprobs=top if echo else None
                    )
                )
                call.ids.append(ids)
                call.prompts.append(text)
        return call

    def reasoning(self, effort: str | None, kwargs: dict) -> tuple[bool | None, dict]:
        """``thinking`` and the template's other arguments: ``enable_thinking`` as given, or
        ``reasoning_effort`` mapped to the template's own switch (a ``reasoning_effort`` variable,
        as gpt-oss has, or ``enable_thinking``: off for none and minimal, on otherwise)."""
        thinking = kwargs.pop("enable_thinking", None)
        if effort is None:
            return (None if thinking is None else bool(thinking)), kwargs
        if thinking is not None:
            raise UserError("give reasoning_effort or chat_template_kwargs.enable_thinking, not both")
        template = str(getattr(self.pipe.lm.template_owner, "chat_template", None) or "")
        if "reasoning_effort" in template:
            return None, {**kwargs, "reasoning_effort": effort}
        if "enable_thinking" in template:
            return effort not in ("none", "minimal"), kwargs
        raise UserError("reasoning_effort: this model's chat template has no reasoning switch")

    @staticmethod
    def constraint(body: Sampling) -> dict:
        """``response_format`` or ``structured_outputs`` as Request fields (one of them)."""
        if body.response_format is not None and body.structured_outputs is not None:
            raise UserError("give response_format or structured_outputs, not both")
        if body.response_format is not None:
            return from_response_format(body.response_format)
        if body.structured_outputs is not None:
            return from_structured_outputs(body.structured_outputs)
        return {}

    def tools(self, body: ChatCompletionRequest) -> tuple[Reading, dict]:
        """How to read the answers, and the request's constraint: its response format, or with
        ``tool_choice`` required or a named function, the call's grammar."""
        constraint = self.constraint(body)
        reading = Reading(thinks=self.think_ids is not None)
        if body.tools is None:
            if body.tool_choice is not None:
                raise UserError("tool_choice needs tools")
            return reading, constraint
        tools, choice = check_tools(body.tools, body.tool_choice)
        lm = self.pipe.lm
        template = getattr(lm.template_owner, "chat_template", None)
        reading.fmt = None if choice == "none" else tool_format(template, lm.tokenizer.get_vocab())
        reading.params = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        tag = None if reading.fmt is None else call_grammar(reading.fmt, tools, choice, body.parallel_tool_calls)
        if tag is not None:
            if constraint:
                raise UserError(
                    "tool_choice required or a named function already constrains the answer: "
                    "leave out response_format / structured_outputs"
                )
            constraint = {"structural_tag": tag}
        return reading, constraint

    def opened(self, ids: Any) -> bool:
        """The prompt ends inside an open think block (the template began the reasoning)."""
        if self.think_ids is None or ids is None:
            return False
        return inside_think(ids.reshape(-1).tolist() if hasattr(ids, "reshape") else list(ids), *self.think_ids)

    def prompts(self, prompt: Any, name: str = "prompt") -> list[tuple[list[int], str]]:
        """A completions ``prompt`` (a string, token ids, or a list of either; ``name``: the field,
        for errors) as (ids, text) pairs."""
        tokenizer = self.pipe.lm.tokenizer
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise UserError(f"{name} is empty")
        vocab = len(tokenizer)
        out = []
        for k, p in enumerate(prompt):
            where = name if len(prompt) == 1 else f"{name}[{k}]"
            if not p:
                raise UserError(f"{where} is empty")
            if isinstance(p, str):
                out.append((tokenizer(p)["input_ids"], p))
                continue
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise UserError(f"{where}: token ids {bad[:5]} are outside the vocabulary of {vocab} tokens")
            out.append((list(p), tokenizer.decode(p)))
        return out

    # --- tokenizer endpoints (vLLM's shapes: lm-eval's remote tokenizer uses them) ----------------
    def tokenize(self, body: TokenizeRequest) -> dict:
        self.models.resolve(body.model)  # an adapter tokenizes as its base does; another model is a 404
        tokenizer = self.pipe.lm.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", code="invalid_value")
        if body.messages is not None:
            messages = [
                {
                    "role": m.role,
                    "content": m.content
                    if isinstance(m.content, str)
                    else "".join(p.text for p in m.content or [] if isinstance(p, TextPart)),
                }
                for m in body.messages
            ]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.add_generation_prompt
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.context(), "tokens": ids, "token_strs": strs}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.models.resolve(body.model)
        tokenizer = self.pipe.lm.tokenizer
        bad = [t for t in body.tokens if not 0 <= t < len(tokenizer)]
        if bad:
            raise APIError(
                400,
                f"tokens: ids {bad[:5]} are outside the vocabulary of {len(tokenizer)} tokens",
                code="invalid_value",
            )
        return {"prompt": tokenizer.decode(body.tokens)}

    def tokenizer_info(self) -> dict:
        tokenizer = self.pipe.lm.tokenizer
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": self.context(),
            "vocab_size": len(tokenizer),
        }

    def context(self) -> int | None:
        """The model's context length, as the engine's limit check reads it."""
        return getattr(text_config(self.pipe.lm.config), "max_position_embeddings", None)

    # --- responses out ----------------------------------------------------------------------
