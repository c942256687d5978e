"""How a sequence leaves the engine: finished (its text, metrics, after-stages, handle) or failed
(its handle raises); either way out of the scheduler, its cache trimmed or released."""

from __future__ import annotations

from pipeline.engine.scheduler import Scheduler
from pipeline.engine.sequence import Sequence, Status


def finish(scheduler: Scheduler, seq: Sequence) -> None:
    """A sequence that ended normally: its text, metrics, after-stages and handle; the cache trimmed
    (or released); a failure on the way fails it instead."""
    retire(scheduler, seq)
    ctx = seq.ctx
    if seq.spec is not None and not seq.prefill_only and ctx.cache.length > seq.known - 1:
        ctx.cache.rollback(seq.known - 1)  # accepted drafts past an EOS or a stop string
    try:
        if seq.output is not None:
            ctx.text = seq.output.final_text(ctx.generated, ctx.finish_reason)
            ctx.metrics.set("decode_tokens", max(0, len(ctx.generated) - 1))
            ctx.metrics.set("generated_tokens", len(ctx.generated))
        ctx.cache.trim()
        ctx.metrics.set("kv_cache_bytes", ctx.cache.nbytes)
        if seq.grammar is not None:
            ctx.metrics.set("grammar_s", seq.grammar.seconds)
        for name, stage in seq.phases.after.items():
            with ctx.metrics.span(name):
                stage(ctx)
        ctx.metrics.end()
        value = seq.phases.finalize(ctx) if seq.phases.finalize is not None else ctx
    except BaseException as err:
        fail(scheduler, seq, err)
        return
    if seq.release:
        ctx.cache.clear()
    handle, seq.handle = seq.handle, None  # no cycle once done: dropping the handle frees the cache
    handle.finish(value)


def fail(scheduler: Scheduler, seq: Sequence, err: BaseException) -> None:
    """A sequence that ends with ``err``: out of the engine, its cache kept whole or released, its handle raises."""
    retire(scheduler, seq)
    try:
        if seq.release:
            seq.ctx.cache.clear()
        else:
            seq.ctx.cache.trim()
    except Exception:
        seq.ctx.cache.clear()
    handle, seq.handle = seq.handle, None
    if handle is not None:
        handle.finish(error=err)


def retire(scheduler: Scheduler, seq: Sequence) -> None:
    """Out of the scheduler, marked finished, its drafter closed."""
    scheduler.remove(seq)
    seq.status = Status.FINISHED
    if seq.spec is not None:
        seq.spec.drafter.close()
