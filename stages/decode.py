"""DecodeLoop: one token per step from the shared KV cache, the Sampler choosing each token."""
from __future__ import annotations

from typing import Callable

import torch

from pipeline.context import Context
from pipeline.errors import UserError
from stages.sampler import Sampler


class TextStream:
    """Incremental detokenisation: emits only text that is complete (no half UTF-8 characters)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.text = text


class DecodeLoop:
    """Samples the first token from prefill's logits, then decodes until EOS, a stop string
    or ``max_new_tokens``. Text streams through ``ctx.on_text`` when set."""

    def __init__(self, sampler: Callable | None = None) -> None:
        self.sampler = sampler if sampler is not None else Sampler()

    def __call__(self, ctx: Context) -> Context:
        req, lm, cache, m = ctx.request, ctx.lm, ctx.cache, ctx.metrics
        if req.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1 (got {req.max_new_tokens})")
        eos = set() if req.ignore_eos else lm.eos_token_ids
        stops = [s for s in req.stop if s]
        stream = TextStream(lm.tokenizer) if (ctx.on_text is not None or stops) else None
        if hasattr(self.sampler, "reset"):
            self.sampler.reset()
        # All ids so far, on the device, for the repetition penalty (written without a host sync).
        prompt_len = ctx.input_ids.shape[1]
        ids = torch.empty((1, prompt_len + req.max_new_tokens), dtype=torch.long, device=ctx.input_ids.device)
        ids[:, :prompt_len] = ctx.input_ids
        model, family = lm.model, lm.family

        with m.span("sample"):
            token = self.sampler(ctx.logits, ids[:, :prompt_len])
        token_id = int(token)
        m.first_token()
        ctx.finish_reason = "length"
        emitted = 0  # characters of text already streamed
        while True:
            n = len(ctx.generated)
            ids[:, prompt_len + n] = token
            ctx.generated.append(token_id)
            if stream is not None:
                stream.push(token_id)
                if stops and any(s in stream.text for s in stops):
                    ctx.finish_reason = "stop"
                    break
                emitted = self._emit(ctx, stream.text, emitted, _holdback(stream.text, stops))
            if token_id in eos:
                ctx.finish_reason = "eos"
                break
            if n + 1 >= req.max_new_tokens:
                break
            position = cache.length
            logits = model(
                input_ids=token.view(1, 1),
                position_ids=family.decode_positions(ctx, position),
                past_key_values=cache.cache,
                use_cache=True,
            ).logits[:, -1]
            cache.append((token_id,))
            m.count("decode_tokens")
            with m.span("sample"):
                token = self.sampler(logits, ids[:, : prompt_len + n + 1])
            token_id = int(token)
        m.set("generated_tokens", len(ctx.generated))
        ctx.text = lm.tokenizer.decode(ctx.generated, skip_special_tokens=True)
        if ctx.finish_reason == "stop":
            ctx.text = ctx.text[: min(ctx.text.find(s) for s in stops if s in ctx.text)]
        self._emit(ctx, ctx.text, emitted, 0)
        return ctx

    @staticmethod
    def _emit(ctx: Context, text: str, emitted: int, holdback: int) -> int:
        """Stream text[emitted : len(text) - holdback]; return the new emitted count."""
        upto = len(text) - holdback
        if ctx.on_text is not None and upto > emitted:
            ctx.on_text(text[emitted:upto])
        return max(emitted, upto)


def _holdback(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that could still grow into a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best
