"""Tokenize: messages -> the model's own chat template -> input ids (and processor outputs)."""

from __future__ import annotations

from typing import Any

import jinja2

from pipeline.context import Context, Request
from pipeline.errors import UserError
from pipeline.families.base import media_name
from pipeline.structured.tools import fallback_messages, renders_tools, template_messages, tool_format


def media_order(request: Request) -> list[str]:
    """The kinds of the request's media in prompt order: ``request.media_order`` when given
    (checked against the media lists), else the images, then the videos, then the audio."""
    counts = {"image": len(request.images), "video": len(request.videos), "audio": len(request.audios)}
    if request.media_order is None:
        return [kind for kind, n in counts.items() for _ in range(n)]
    order = list(request.media_order)
    unknown = sorted(set(order) - set(counts))
    if unknown:
        raise ValueError(f"Request.media_order: unknown kind {unknown[0]!r} (image, video, audio)")
    for kind, n in counts.items():
        if order.count(kind) != n:
            raise ValueError(f"Request.media_order lists {order.count(kind)} {kind}(s) but the request has {n}")
    return order


def build_messages(request: Request, family, default_prompt: str | None = None) -> list[dict]:
    """The conversation to render. With only a prompt: one user message, media first (in the
    order given), then text."""
    if request.messages:
        messages = [dict(m) for m in request.messages]
    else:
        text = request.prompt if request.prompt is not None else default_prompt
        if text is None or not str(text).strip():
            raise UserError("the prompt is empty: give prompt=TEXT (or an image/video/audio input)")
        content = family.content(str(text), len(request.images), len(request.audios), kinds=media_order(request))
        messages = [{"role": "user", "content": content}]
    if request.system_prompt:
        if messages and messages[0].get("role") == "system":
            raise UserError("system_prompt given twice: in the settings and as the first message")
        messages.insert(0, {"role": "system", "content": request.system_prompt})
    return messages


def _sources(items: list, kind: str) -> str:
    """The media's file names for an error message (paths, or PIL images tagged with info["source"])."""
    return ", ".join(media_name(item, kind, i) for i, item in enumerate(items))


class Tokenize:
    """Renders the conversation with the model's chat template and tokenizes it.

    ``default_image_prompt`` / ``default_video_prompt`` / ``default_audio_prompt`` apply when
    media come without a prompt (a video's when there is one, else an image's, else audio's).
    Left at None, the model's own question is asked when it has one (``lm.default_prompts``),
    else ``GENERIC_PROMPTS``.
    ``long_audio`` (split | error): what to do with audio longer than the encoder's window.
    ``use_audio_in_video``: a video's own audio track is heard with it, by models that can
    (a family with ``audio_in_video``: Qwen2.5-Omni); a video given to another model is refused.
    """

    GENERIC_PROMPTS = {
        "image": "Describe this image.",
        "video": "Describe this video.",
        "audio": "What is said or heard in this audio?",
    }

    def __init__(
        self,
        default_image_prompt: str | None = None,
        default_audio_prompt: str | None = None,
        long_audio: str = "split",
        default_video_prompt: str | None = None,
        use_audio_in_video: bool = False,
    ) -> None:
        self.default_image_prompt = default_image_prompt
        self.default_audio_prompt = default_audio_prompt
        self.default_video_prompt = default_video_prompt
        self.long_audio = long_audio
        self.use_audio_in_video = bool(use_audio_in_video)

    def default_prompt(self, req: Request, lm: Any = None) -> str | None:
        """The question asked of the request's media when it has no prompt: this stage's setting,
        else the model's own (``lm.default_prompts``), else the generic one."""
        kind = "video" if req.videos else "image" if req.images else "audio" if req.audios else None
        if kind is None:
            return None
        chosen = {
            "image": self.default_image_prompt,
            "video": self.default_video_prompt,
            "audio": self.default_audio_prompt,
        }[kind]
        if chosen is not None:
            return chosen
        return (getattr(lm, "default_prompts", None) or {}).get(kind) or self.GENERIC_PROMPTS[kind]

    def __call__(self, ctx: Context) -> Context:
        req, lm = ctx.request, ctx.lm
        for kind, items in (("image", req.images), ("video", req.videos), ("audio", req.audios)):
            if items and kind not in lm.family.media:
                raise UserError(
                    f"{_sources(items, kind)}: {lm.path} is a {lm.family.name} model without "
                    f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} encoder: "
                    f"cannot take {kind} input"
                )
        # Media at the model's rate / within its windows; later stages read the prepared request.
        hear = {"use_audio_in_video": True} if self.use_audio_in_video and req.videos else {}
        if hear and not lm.family.audio_in_video:
            raise UserError(
                f"media.use_audio_in_video: {lm.path} is a {lm.family.name} model: it cannot hear a "
                "video's audio track (set media.use_audio_in_video=false)"
            )
        req = ctx.request = lm.family.prepare(lm, req, long_audio=self.long_audio, **hear)
        messages = build_messages(req, lm.family, self.default_prompt(req, lm))
        template_owner = lm.template_owner
        if getattr(template_owner, "chat_template", "present") is None:
            raise UserError(f"{lm.path} has no chat template: this program needs a chat (instruct) model")
        extra = {
            **(req.chat_template_kwargs or {}),
            **({} if req.thinking is None else {"enable_thinking": bool(req.thinking)}),
        }
        messages, extra = with_tools(messages, extra, req.tools, template_owner, lm.tokenizer)
        text = render(template_owner, messages, extra, req.add_generation_prompt, req.continue_final_message)
        if lm.processor is not None:
            inputs = lm.family.process(lm, text, req)
        else:
            inputs = lm.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        inputs = dict(inputs)
        inputs.pop("attention_mask", None)
        ctx.input_ids = inputs.pop("input_ids").to(lm.device)
        ctx.model_inputs = inputs
        ctx.extras["prompt_text"] = text
        ctx.token_keys = lm.family.token_keys(ctx)
        if getattr(lm, "recurrent", False) and req.add_generation_prompt:
            ctx.reply_start = _reply_start(template_owner, lm.tokenizer, messages, text, ctx.input_ids.shape[1], extra)
        return ctx


def render(
    owner: Any, messages: list[dict], extra: dict, add_generation_prompt: bool = True, continue_final: bool = False
) -> str:
    """The prompt text: a new reply's header after the conversation (``add_generation_prompt``),
    or the last, assistant, message left open to be continued (``continue_final``). A conversation
    the template refuses (Gemma's alternating roles, a misplaced system message) is the user's
    error, in the template's own words."""
    if continue_final and add_generation_prompt:
        raise UserError("continue_final_message needs add_generation_prompt false: the last message is continued")
    if continue_final and (not messages or messages[-1].get("role") != "assistant"):
        raise UserError("continue_final_message needs the last message to be the assistant's")
    try:
        return owner.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            tokenize=False,
            **extra,
        )
    except jinja2.TemplateError as err:
        raise UserError(f"the model's chat template refused these messages: {err}") from None


def with_tools(
    messages: list[dict], extra: dict, tools: list[dict] | None, owner: Any, tokenizer: Any
) -> tuple[list[dict], dict]:
    """The conversation and template arguments with the request's tools: given to a template that
    renders them, else written into the messages (``pipeline.structured.tools.fallback_messages``)."""
    has_calls = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not tools and not has_calls:
        return messages, extra
    template = getattr(owner, "chat_template", None)
    if renders_tools(template):
        return template_messages(messages), {**extra, **({"tools": tools} if tools else {})}
    return fallback_messages(messages, tools or [], tool_format(template, tokenizer.get_vocab())), extra


def _reply_start(owner: Any, tokenizer: Any, messages: list[dict], text: str, length: int, extra: dict) -> int | None:
    """The prompt position where the template's generation prompt (``<|im_start|>assistant\n``
    and, with thinking off, an empty think block) begins. A template may render an earlier
    answer differently from how it was generated (Qwen3.5 drops the empty think block), so the
    next chat turn shares the prompt only up to about here: a model with recurrent states keeps
    its state at this position (``KVCache.checkpoint_at``) instead of recomputing the turn."""
    bare = owner.apply_chat_template(messages, add_generation_prompt=False, tokenize=False, **extra)
    if not text.startswith(bare) or len(text) == len(bare):
        return None
    header = len(tokenizer(text[len(bare) :], add_special_tokens=False)["input_ids"])
    return length - header if 0 < header < length else None
