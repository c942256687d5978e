"""DecodeLoop: one token per step from the shared KV cache, the Sampler choosing each token.

Two paths, the same tokens:

- plain (default): the model's eager forward each step; the host reads every token as it
  comes (EOS, stop strings and streaming act at once).
- fast (``compile=True``, gpt-fast style): the one-token step runs under ``torch.compile``
  (CUDA graphs via mode ``reduce-overhead`` on GPU) against a static KV cache; tokens stay on
  the device and the host reads them every ``check_every`` steps, then trims any overshoot
  past EOS / a stop string, so the output is identical to the plain path. Where the step
  cannot be compiled (dynamic cache, bitsandbytes weights, a compile error) it warns once
  (``FastPathFallback``) and decodes eagerly.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import torch

from pipeline.context import Context
from pipeline.errors import UserError, whole_number
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


class FastPathFallback(UserWarning):
    """``decode.compile`` was asked for but this model / cache cannot use it: decoding is eager."""


def decode_step(model: Any, token: torch.Tensor, positions: torch.Tensor, past_key_values: Any) -> torch.Tensor:
    """One token through the model -> next-token logits [1, V]. The unit ``torch.compile`` sees."""
    out = model(input_ids=token, position_ids=positions, past_key_values=past_key_values, use_cache=True)
    return out.logits[:, -1]


class _SampleClock:
    """Sampler time without a host sync per step: perf_counter on CPU (ops there are synchronous),
    CUDA events on GPU, read once at the end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.calls = 0
        self._pairs: list[tuple[Any, Any]] = []
        self._t0: Any = None

    def start(self) -> None:
        if self.cuda:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        self.calls += 1
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pairs.append((self._t0, end))
        else:
            self.seconds += time.perf_counter() - self._t0

    def total(self) -> float:
        if self._pairs:
            self._pairs[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self._pairs) / 1e3
            self._pairs.clear()
        return self.seconds


class DecodeLoop:
    """Samples the first token from prefill's logits, then decodes until EOS, a stop string
    or ``max_new_tokens``. Text streams through ``ctx.on_text`` when set.

    ``compile``: the fast path (see the module docstring); it needs a static KV cache
    (``kv.static=true``). ``check_every``: decode steps between host reads of the new tokens
    (default 1 on the plain path, 8 on the fast path; streaming then arrives in chunks of that
    many tokens). ``compile_mode``: ``torch.compile`` mode (default ``reduce-overhead`` on CUDA,
    inductor's default elsewhere); ``compile_backend``: ``inductor``, or e.g. ``aot_eager`` to
    check graph capture without paying for code generation.
    """

    def __init__(
        self,
        sampler: Callable | None = None,
        compile: bool = False,
        check_every: int | None = None,
        compile_mode: str | None = None,
        compile_backend: str = "inductor",
    ) -> None:
        self.sampler = sampler if sampler is not None else Sampler()
        self.compile = bool(compile)
        self.check_every = (
            None if check_every is None else whole_number("decode.check_every", check_every, error=ValueError)
        )
        self.compile_mode = compile_mode
        self.compile_backend = compile_backend
        self._compiled: tuple[Any, Callable] | None = None  # (model, its compiled step)
        self._verified = False  # the compiled step has run once without error
        self._broken: str | None = None  # why compiling failed, once it did
        self._warned = False

    # --- choosing the step ------------------------------------------------------------------
    def _why_not_compiled(self, ctx: Context) -> str | None:
        """Why this request cannot take the compiled step (None: it can)."""
        if self._broken:
            return self._broken
        if not ctx.cache.is_static:
            return "the compiled step needs a static KV cache (kv.static=true)"
        quantizer = getattr(ctx.lm.model, "hf_quantizer", None)
        if quantizer is not None and not getattr(quantizer, "is_compileable", False):
            return f"{ctx.lm.quant} quantised weights ({type(quantizer).__name__}) cannot be compiled"
        return None

    def _fallback(self, reason: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"decode.compile: {reason}; decoding uncompiled", FastPathFallback, stacklevel=3)

    def _mode(self, device: torch.device) -> str | None:
        if self.compile_mode is not None:
            return self.compile_mode
        if self.compile_backend != "inductor":
            return None  # modes are inductor options
        return "reduce-overhead" if device.type == "cuda" else None

    def step_for(self, ctx: Context) -> tuple[Callable, bool]:
        """(decode step, compiled?) for this request: compiled when asked for and possible."""
        if not self.compile:
            return decode_step, False
        reason = self._why_not_compiled(ctx)
        if reason is not None:
            self._fallback(reason)
            return decode_step, False
        model = ctx.lm.model
        if self._compiled is None or self._compiled[0] is not model:
            mode = self._mode(ctx.input_ids.device)
            step = torch.compile(decode_step, backend=self.compile_backend, mode=mode, dynamic=False, fullgraph=False)
            self._compiled = (model, step)
            self._verified = False
        return self._compiled[1], True

    # --- the loop -----------------------------------------------------------------------------
    @torch.inference_mode()
    def __call__(self, ctx: Context) -> Context:
        req, lm, cache, m = ctx.request, ctx.lm, ctx.cache, ctx.metrics
        max_new = req.max_new_tokens
        if max_new < 1:
            raise UserError(f"max_new_tokens must be >= 1 (got {max_new})")
        cache.ensure_capacity(cache.length + max_new - 1)
        eos = frozenset() if req.ignore_eos else frozenset(lm.eos_token_ids)
        stops = [s for s in req.stop if s]
        stream = TextStream(lm.tokenizer) if (ctx.on_text is not None or stops) else None
        if hasattr(self.sampler, "reset"):
            self.sampler.reset()
        step, compiled = self.step_for(ctx)
        every = self.check_every or (8 if compiled else 1)
        mark_step = (
            torch.compiler.cudagraph_mark_step_begin
            if compiled and self._mode(ctx.input_ids.device) == "reduce-overhead"
            else None
        )
        model, past = lm.model, cache.cache
        device = ctx.input_ids.device
        prompt_len = ctx.input_ids.shape[1]
        # Prompt + generated ids on the device, for the repetition penalty. Slots not generated
        # yet hold -1, which the Sampler ignores: one fixed shape, written without a host sync.
        ids = torch.full((1, prompt_len + max_new), -1, dtype=torch.long, device=device)
        ids[:, :prompt_len] = ctx.input_ids
        clock = _SampleClock(device)
        m.set("kv_bytes_decode_start", cache.nbytes)

        clock.start()
        token = self.sampler(ctx.logits, ids)
        clock.stop()
        ids[:, prompt_len] = token
        first = int(token)  # the one sync TTFT needs: the first token's value on the host
        m.first_token()
        ctx.finish_reason = "length"
        emitted = 0  # characters of text already streamed

        def accept(token_id: int) -> bool:
            """Host side of one token: record, stream, stop checks. True when decoding ends."""
            nonlocal emitted
            ctx.generated.append(token_id)
            if stream is not None:
                stream.push(token_id)
                if stops and any(s in stream.text for s in stops):
                    ctx.finish_reason = "stop"
                    return True
                emitted = self._emit(ctx, stream.text, emitted, _holdback(stream.text, stops))
            if token_id in eos:
                ctx.finish_reason = "eos"
                return True
            return len(ctx.generated) >= max_new

        produced = 1  # tokens sampled so far (on the device; the host has read `checked`)
        try:
            done = accept(first)
            # Positions advance by one per decode token in every family (Qwen2-VL's M-RoPE
            # rows included), so they are built once and incremented on the device.
            positions = lm.family.decode_positions(ctx, cache.length) if not done else None
            while not done:
                checked = produced
                for _ in range(min(every, max_new - produced)):
                    if mark_step is not None:
                        mark_step()
                    if compiled and not self._verified:
                        step, compiled, logits = self._first_compiled_call(ctx, step, token, positions)
                    else:
                        logits = step(model, token.view(1, 1), positions, past)
                    positions = positions + 1
                    clock.start()
                    token = self.sampler(logits, ids)
                    clock.stop()
                    ids[:, prompt_len + produced] = token
                    produced += 1
                for token_id in ids[0, prompt_len + checked : prompt_len + produced].tolist():
                    if accept(token_id):
                        done = True
                        break
        finally:
            # The cache holds prompt + every token fed; keep exactly prompt + generated[:-1]
            # (the last token is not fed yet) and drop steps run past EOS / a stop string.
            cache.append(ctx.generated[:-1])
            cache.trim()
            m.add_span("sample", clock.total(), clock.calls)
            m.info["decode_compiled"] = compiled
        m.count("decode_tokens", len(ctx.generated) - 1)
        m.set("generated_tokens", len(ctx.generated))
        ctx.text = lm.tokenizer.decode(ctx.generated, skip_special_tokens=True)
        if ctx.finish_reason == "stop":
            ctx.text = ctx.text[: min(ctx.text.find(s) for s in stops if s in ctx.text)]
        self._emit(ctx, ctx.text, emitted, 0)
        return ctx

    def _first_compiled_call(
        self, ctx: Context, step: Callable, token: torch.Tensor, positions: torch.Tensor
    ) -> tuple[Callable, bool, torch.Tensor]:
        """Run the compiled step the first time; if compiling fails, warn once and go eager.

        Nothing has been fed yet in this request (this is its first decode step), so dropping
        whatever the failed attempt wrote restores the cache exactly.
        """
        model, past = ctx.lm.model, ctx.cache.cache
        try:
            logits = step(model, token.view(1, 1), positions, past)
        except Exception as err:  # dynamo/inductor raise many types; all mean "cannot compile this"
            first_line = (str(err).strip().splitlines() or [""])[0][:200]
            self._broken = f"torch.compile failed ({type(err).__name__}: {first_line})"
            self._compiled = None
            self._fallback(self._broken)
            ctx.cache.trim()
            return decode_step, False, decode_step(model, token.view(1, 1), positions, past)
        self._verified = True
        return step, True, logits

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
