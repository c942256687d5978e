"""Pipeline: runs stages in order over one Context and times each the same way."""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import torch

from pipeline.context import Context, Request, Result
from pipeline.kv_cache import KVCache
from pipeline.loading import LoadedModel
from pipeline.metrics import Metrics, decode_weight_bytes, synchronize

Stage = Callable[[Context], Any]


class Pipeline:
    """An ordered, named chain of stages. Names become metric keys (``stages.<name>.seconds``).

    A stage may define ``skip(ctx) -> bool`` (e.g. the vision encoder on a text-only prompt);
    skipped stages record nothing.

    ``kv_static=True`` makes ``new_cache()`` pre-allocate ``kv_max_len`` positions (what the
    compiled decode step needs). Runs given no cache then share one such cache, cleared at the
    start of each run, so compiled code (and CUDA graphs) keep the same addresses; pass your
    own ``new_cache()`` to keep a conversation.
    """

    def __init__(
        self,
        lm: LoadedModel,
        stages: Mapping[str, Stage],
        *,
        kv_static: bool = False,
        kv_max_len: int = 4096,
    ) -> None:
        self.lm = lm
        self.stages = dict(stages)
        self.kv_static = bool(kv_static)
        self.kv_max_len = int(kv_max_len)
        self.warmup_s: float | None = None  # time spent in warmup(), reported apart from ttft_s
        self._shared_cache: KVCache | None = None
        self._decode_weights: int | None = None  # bytes a decode step reads (metrics.decode_weight_bytes)

    def new_cache(self) -> KVCache:
        return KVCache(self.lm.config, static=self.kv_static, max_cache_len=self.kv_max_len)

    def _fresh_cache(self) -> KVCache:
        """An empty cache for a run that brought none (static: the shared one, cleared)."""
        if not self.kv_static:
            return self.new_cache()
        if self._shared_cache is None:
            self._shared_cache = self.new_cache()
        self._shared_cache.clear()
        return self._shared_cache

    @torch.inference_mode()
    def warmup(self, prompt_tokens: int = 16, new_tokens: int | None = None) -> float:
        """Compile and run prefill + decode once on a throwaway prompt (MNN's "tuning"), so that
        the first real request pays no compile time; returns the seconds, also kept in
        ``warmup_s`` and reported in each result's metrics, never in ``ttft_s``.

        Decode runs enough steps for CUDA graphs to be recorded and replayed (2 x check_every + 2).
        """
        t0 = time.perf_counter()
        decode = self.stages.get("decode")
        every = getattr(decode, "check_every", None) or 8
        n = new_tokens or 2 * every + 2
        text = " ".join(["warm"] * prompt_tokens)
        ids = self.lm.tokenizer(text, add_special_tokens=False)["input_ids"][:prompt_tokens] or [0]
        ctx = self.run_ids(ids, Request(max_new_tokens=n, ignore_eos=True))
        ctx.cache.clear()
        synchronize(self.lm.device)
        seconds = time.perf_counter() - t0
        self.warmup_s = (self.warmup_s or 0.0) + seconds
        return seconds

    @torch.inference_mode()
    def run(
        self,
        request: Request,
        cache: KVCache | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Result:
        """Run one request. Pass the same ``cache`` again to reuse what it already holds."""
        return self.result(self.run_context(request, cache, on_text))

    @torch.inference_mode()
    def run_context(
        self,
        request: Request,
        cache: KVCache | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Context:
        """Like ``run`` but returns the whole Context, for recipes that need more than the Result
        (e.g. C-Eval scores prefill's next-token logits)."""
        return self._run_stages(self.context(request, cache, on_text), self.stages)

    @torch.inference_mode()
    def run_ids(
        self,
        ids: Sequence[int],
        request: Request,
        cache: KVCache | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Context:
        """Run the stages after tokenization on raw prompt ids (no chat template, no media):
        synthetic benchmark prompts, cache experiments, tests."""
        ctx = self.context(request, cache, on_text)
        ctx.input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.lm.device)
        ctx.token_keys = list(ids)
        return self._run_stages(ctx, {k: v for k, v in self.stages.items() if k != "tokenize"})

    @staticmethod
    def _run_stages(ctx: Context, stages: Mapping[str, Stage]) -> Context:
        """Run stages in order, each timed the same way (device-synchronised span)."""
        ctx.metrics.start()
        for name, stage in stages.items():
            skip = getattr(stage, "skip", None)
            if skip is not None and skip(ctx):
                continue
            with ctx.metrics.span(name):
                stage(ctx)
        ctx.metrics.end()
        return ctx

    @torch.inference_mode()
    def tokenize(self, request: Request) -> Context:
        """Only the tokenize stage: the ids and cache keys a request renders to."""
        ctx = self.context(request)
        self.stages["tokenize"](ctx)
        return ctx

    def context(
        self, request: Request, cache: KVCache | None = None, on_text: Callable[[str], None] | None = None
    ) -> Context:
        """A fresh Context, for users who drive stages by hand."""
        return Context(
            request=request,
            lm=self.lm,
            cache=cache if cache is not None else self._fresh_cache(),
            metrics=Metrics(self.lm.device),
            on_text=on_text,
        )

    def result(self, ctx: Context) -> Result:
        m = ctx.metrics
        m.set("kv_cache_bytes", ctx.cache.nbytes)
        m.set("weights_bytes", self.lm.weights_bytes)
        if self._decode_weights is None:
            self._decode_weights = decode_weight_bytes(self.lm.model)
        m.set("decode_weights_bytes", self._decode_weights)
        if self.warmup_s is not None:
            m.set("warmup_s", self.warmup_s)
        m.info["quant"] = self.lm.quant
        m.info["placement"] = {dev: dict(kinds) for dev, kinds in self.lm.placement.items()}  # device -> kind -> bytes
        return Result(
            text=ctx.text,
            token_ids=list(ctx.generated),
            prompt_ids=ctx.input_ids[0].tolist() if ctx.input_ids is not None else [],
            metrics=m.to_dict(),
            finish_reason=ctx.finish_reason,
        )
