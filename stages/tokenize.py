"""Tokenize: messages -> the model's own chat template -> input ids (and processor outputs)."""
from __future__ import annotations

from pipeline.context import Context, Request
from pipeline.errors import UserError
from pipeline.families.base import media_name


def build_messages(request: Request, family, default_prompt: str | None = None) -> list[dict]:
    """The conversation to render. With only a prompt: one user message, media first, then text."""
    if request.messages:
        messages = [dict(m) for m in request.messages]
    else:
        text = request.prompt if request.prompt is not None else default_prompt
        if text is None or not str(text).strip():
            raise UserError("the prompt is empty: give prompt=TEXT (or an image/audio input)")
        content = family.content(str(text), len(request.images), len(request.audios))
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

    ``default_image_prompt`` / ``default_audio_prompt`` apply when media come without a prompt.
    ``long_audio`` (split | error): what to do with audio longer than the encoder's window.
    """

    def __init__(
        self,
        default_image_prompt: str = "Describe this image.",
        default_audio_prompt: str = "What is said or heard in this audio?",
        long_audio: str = "split",
    ) -> None:
        self.default_image_prompt = default_image_prompt
        self.default_audio_prompt = default_audio_prompt
        self.long_audio = long_audio

    def __call__(self, ctx: Context) -> Context:
        req, lm = ctx.request, ctx.lm
        for kind, items in (("image", req.images), ("audio", req.audios)):
            if items and kind not in lm.family.media:
                raise UserError(
                    f"{_sources(items, kind)}: {lm.path} is a {lm.family.name} model without an {kind} encoder: "
                    f"cannot take {kind} input"
                )
        # Media at the model's rate / within its windows; later stages read the prepared request.
        req = ctx.request = lm.family.prepare(lm, req, long_audio=self.long_audio)
        default = self.default_image_prompt if req.images else self.default_audio_prompt if req.audios else None
        messages = build_messages(req, lm.family, default)
        template_owner = lm.processor if lm.processor is not None else lm.tokenizer
        if getattr(template_owner, "chat_template", "present") is None:
            raise UserError(f"{lm.path} has no chat template: this program needs a chat (instruct) model")
        extra = {} if req.thinking is None else {"enable_thinking": bool(req.thinking)}
        text = template_owner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
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
        return ctx
