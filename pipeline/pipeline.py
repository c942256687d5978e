"""Pipeline: runs stages in order over one Context and times each the same way."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from pipeline.context import Context, Request, Result
from pipeline.kv_cache import KVCache
from pipeline.loading import LoadedModel
from pipeline.metrics import Metrics

Stage = Callable[[Context], Any]


class Pipeline:
    """An ordered, named chain of stages. Names become metric keys (``stages.<name>.seconds``).

    A stage may define ``skip(ctx) -> bool`` (e.g. the vision encoder on a text-only prompt);
    skipped stages record nothing.
    """

    def __init__(self, lm: LoadedModel, stages: Mapping[str, Stage]) -> None:
        self.lm = lm
        self.stages = dict(stages)

    def new_cache(self) -> KVCache:
        return KVCache(self.lm.config)

    @torch.inference_mode()
    def run(
        self,
        request: Request,
        cache: KVCache | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Result:
        """Run one request. Pass the same ``cache`` again to reuse what it already holds."""
        ctx = self.context(request, cache, on_text)
        ctx.metrics.start()
        for name, stage in self.stages.items():
            skip = getattr(stage, "skip", None)
            if skip is not None and skip(ctx):
                continue
            with ctx.metrics.span(name):
                stage(ctx)
        ctx.metrics.end()
        return self.result(ctx)

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
            cache=cache if cache is not None else self.new_cache(),
            metrics=Metrics(self.lm.device),
            on_text=on_text,
        )

    def result(self, ctx: Context) -> Result:
        m = ctx.metrics
        m.set("kv_cache_bytes", ctx.cache.nbytes)
        m.set("weights_bytes", self.lm.weights_bytes)
        m.info["quant"] = self.lm.quant
        return Result(
            text=ctx.text,
            token_ids=list(ctx.generated),
            prompt_ids=ctx.input_ids[0].tolist() if ctx.input_ids is not None else [],
            metrics=m.to_dict(),
            finish_reason=ctx.finish_reason,
        )
