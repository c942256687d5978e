"""Prefill: compute the prompt's keys/values into the shared cache, keeping what is already there."""
from __future__ import annotations

import torch

from pipeline.context import Context
from pipeline.errors import UserError, whole_number
from pipeline.memory import check_kv_fits


class Prefill:
    """Fills the KV cache with the prompt suffix it does not already hold; leaves next-token logits.

    ``chunk_size`` bounds peak activation memory on long prompts (same output as one pass).
    """

    def __init__(self, chunk_size: int | None = None) -> None:
        self.chunk_size = (
            None if chunk_size is None else whole_number("prefill.chunk_size", chunk_size, error=ValueError)
        )

    @torch.inference_mode()  # as in Pipeline.run, also when driven by hand (static caches need it)
    def __call__(self, ctx: Context) -> Context:
        lm, cache, m = ctx.lm, ctx.cache, ctx.metrics
        total = ctx.input_ids.shape[1]
        if total == 0:
            raise UserError("the prompt has no tokens: there is nothing to prefill")
        start = cache.reuse(ctx.token_keys)
        # Stop now, with the numbers, if prompt + max_new_tokens of cache cannot fit (pipeline/memory.py).
        check_kv_fits(lm, cache, total, ctx.request.max_new_tokens)
        cache.ensure_capacity(total)  # a static cache refuses, in one line, what it cannot hold
        m.set("prompt_tokens", total)
        m.set("kv_reused_tokens", start)
        m.set("prefill_tokens", total - start)
        positions = lm.family.prompt_positions(ctx, start)  # [..., total - start]
        step = self.chunk_size or (total - start)
        for begin in range(start, total, step):
            end = min(begin + step, total)
            if ctx.inputs_embeds is not None:
                inputs = {"inputs_embeds": ctx.inputs_embeds[:, begin:end]}
            else:
                inputs = {"input_ids": ctx.input_ids[:, begin:end]}
            out = lm.model(
                **inputs,
                position_ids=positions[..., begin - start : end - start],
                past_key_values=cache.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache.append(ctx.token_keys[begin:end])
        ctx.logits = out.logits[:, -1]
        return ctx
