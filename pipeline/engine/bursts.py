"""Greedy decode bursts: several decode steps run back to back with no host work between them,
when every sequence in the step only takes the argmax (gpt-fast's lesson: at small batch a
step's Python costs as much as its arithmetic)."""

from __future__ import annotations

from pipeline.engine.intake import make_chunk
from pipeline.engine.scheduler import Scheduled
from pipeline.errors import OutOfBlocks
from pipeline.runner import ModelRunner, StepOutput
from pipeline.sampling import argmax_only


def length(plan: list[Scheduled], limit: int, quiet: bool) -> int:
    """How many decode steps this step may run back to back (1: an ordinary step).

    A burst needs a decode-only step of argmax-only sequences (no logits processors, no drafts,
    no log-probabilities asked); it is as long as the sequence with the fewest tokens left allows,
    at most ``limit``. ``quiet``: no waiting request could be admitted now (none waits, or every
    place is taken by sequences none of them outranks: a burst delays no admission but one freed
    by an early end) and the pool holds no recurrent states (those are read and written per
    step, not inside a burst).
    """
    if limit < 2 or not quiet:
        return 1
    steps = limit
    for item in plan:
        seq = item.seq
        decoding = item.end - item.begin == 1 and item.begin >= seq.prompt_len and seq.known - item.begin == 1
        if (
            not decoding
            or seq.prefill_only
            or seq.spec is not None
            or seq.phases.processors
            or seq.grammar
            or not argmax_only(seq.sampler)
            or seq.ctx.request.logprobs is not None
            or seq.output.held(len(seq.ctx.generated))  # min_new_tokens: its end ids are masked
        ):
            return 1
        steps = min(steps, seq.ctx.request.max_new_tokens - len(seq.ctx.generated))
    return steps


def run(runner: ModelRunner, plan: list[Scheduled], steps: int) -> StepOutput:
    """``steps`` greedy decode steps on the device (the host side of every token follows in
    ``Engine._take_burst``); one step when the pool has no room to run ahead."""
    try:
        for item in plan:
            item.seq.cache.reserve(steps)  # the step's one slot already reserved, the rest now
    except OutOfBlocks:
        steps = 1  # no room to run ahead: one step, the slots reserved so far used as they come
    chunks = [make_chunk(item) for item in plan]
    positions = [[c.positions[r][0] for c in chunks] for r in range(len(chunks[0].positions))]
    return runner.burst(
        [c.ids[0] for c in chunks],
        positions,
        [c.start for c in chunks],
        [item.seq.cache.blocks for item in plan],
        steps,
        [c.adapter for c in chunks],
    )
