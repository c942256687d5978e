"""Where a token is chosen: after a forward, each sequence's logits processors and grammar mask,
then its sampler (argmax rows together), the log-probabilities it asked for, all read back in one
transfer; then the host side of the chosen token (its grammar, stop checks, stream, hooks). The
prompt's own log-probabilities (``prompt_logprobs``) are read with them. The engine calls these;
the sampling itself (samplers, processors, log-probabilities) lives in ``pipeline.sampling``.
"""

from __future__ import annotations

import time

import torch

from pipeline.context import TokenLogprob
from pipeline.engine.intake import scoring_positions
from pipeline.engine.scheduler import Scheduled
from pipeline.engine.sequence import Sequence
from pipeline.runner import grammar
from pipeline.sampling import apply_processors, choose, logprobs
from pipeline.transfer import read, upload


def pick(
    seqs: list[Sequence], logits: torch.Tensor, also: torch.Tensor | None = None
) -> tuple[list[int], float, list[TokenLogprob | None], list[float]]:
    """Each sequence's logits processors (one call per processor for all its rows), then one
    token per sequence (argmax rows together, other samplers on their own rows), the seconds
    that took, and the log-probabilities the sequences asked for (``Request.logprobs``), read
    back with the tokens in one transfer, and with ``also`` (a flat float tensor, read too:
    its values come last)."""
    t0 = time.perf_counter()
    raw = logits
    logits = apply_processors(logits, [s.ctx for s in seqs], [s.phases.processors for s in seqs])
    logits = hold_ends(logits, [(i, s, len(s.ctx.generated)) for i, s in enumerate(seqs)])
    logits = grammar.mask(logits, [s.grammar for s in seqs])
    samplers = [s.sampler for s in seqs]
    chosen = choose(logits, samplers, lambda i: seqs[i].ids, lambda i: seqs[i].ctx.generated)
    asked = [i for i, s in enumerate(seqs) if s.ctx.request.logprobs is not None]
    extra = [] if also is None else [also.double()]
    if not asked:
        values = read(torch.cat([chosen.double(), *extra]) if extra else chosen)
        n = len(seqs)
        return [int(t) for t in values[:n]], time.perf_counter() - t0, [None] * n, values[n:]
    k = max(seqs[i].ctx.request.logprobs for i in asked)
    table = logprob_table(seqs, asked, raw, logits, chosen, k)
    values = read(torch.cat([chosen.double(), table.flatten(), *extra]))
    tokens, width = [int(t) for t in values[: len(seqs)]], 1 + 2 * k
    entries: list[TokenLogprob | None] = [None] * len(seqs)
    for j, i in enumerate(asked):
        row = values[len(seqs) + j * width : len(seqs) + (j + 1) * width]
        lp, top = logprobs.unpack(row, k, seqs[i].ctx.request.logprobs)
        entries[i] = TokenLogprob(tokens[i], lp, top)
    return tokens, time.perf_counter() - t0, entries, values[len(seqs) + len(asked) * width :]


def hold_ends(logits: torch.Tensor, rows: list[tuple[int, Sequence, int]]) -> torch.Tensor:
    """``logits`` with the ids that would end an answer (EOS, ``stop_token_ids``) at -inf in each
    row ``(row, seq, generated)`` whose sequence has fewer than ``min_new_tokens`` tokens there."""
    index: list[int] = []
    ids: list[int] = []
    for row, seq, generated in rows:
        if seq.output is not None and seq.output.held(generated):
            ends = sorted(seq.output.ends)
            index += [row] * len(ends)
            ids += ends
    if not ids:
        return logits
    held = logits.clone()
    held[upload(index, logits.device), upload(ids, logits.device)] = float("-inf")
    return held


def logprob_table(
    seqs: list[Sequence], asked: list[int], raw: torch.Tensor, logits: torch.Tensor, chosen: torch.Tensor, k: int
) -> torch.Tensor:
    """``logprobs.table`` of the ``asked`` rows: from the model's ``raw`` logits, or for
    ``logprobs_mode="processed"`` rows from ``logits`` after processors and the sampler's filters."""
    index = upload(asked, logits.device)
    scores = raw.index_select(0, index)
    if any(seqs[i].ctx.request.logprobs_mode == "processed" for i in asked):
        processed = logprobs.processed_scores(
            logits.index_select(0, index),
            [seqs[i].sampler for i in asked],
            lambda j: seqs[asked[j]].ids,
            lambda j: seqs[asked[j]].ctx.generated,
        )
        modes = upload(
            [seqs[i].ctx.request.logprobs_mode == "processed" for i in asked], logits.device, dtype=torch.bool
        )
        scores = torch.where(modes[:, None], processed, scores.float())
    return logprobs.table(scores, chosen.index_select(0, index), k)


def take(seq: Sequence, token_id: int) -> str | None:
    """Record one new token; the finish reason if the sequence ends with it."""
    ctx = seq.ctx
    if not ctx.generated:
        ctx.metrics.first_token()
    if seq.grammar is not None:
        seq.grammar.accept(token_id)
    ctx.generated.append(token_id)
    seq.ids.append(token_id)
    seq.keys.append(token_id)
    if seq.handle is not None:
        seq.handle.push(token_id)
    reason = seq.output.accept(ctx.generated)
    if reason is None and seq.grammar is not None and seq.grammar.terminated:
        reason = "stop"  # the grammar is complete (its stop token taken, or EOS ignored)
    decode = seq.phases.decode
    if reason is None and decode is not None and decode.on_token(ctx, token_id):
        reason = "stop"
    return reason


def prompt_scores(scoring: list[tuple[Scheduled, int]], logits: torch.Tensor) -> torch.Tensor | None:
    """The prompt rows of the parts that score their prompt (``Request.prompt_logprobs``), as
    one flat ``logprobs.table`` of every such row (each part's first rows, from ``row``)."""
    if not scoring:
        return None
    index, targets = [], []
    for item, row in scoring:
        positions = scoring_positions(item)
        index += range(row, row + len(positions))
        targets += item.seq.ids[positions.start + 1 : positions.stop + 1]
    k = max(item.seq.ctx.request.prompt_logprobs for item, _ in scoring)
    device = logits.device
    return logprobs.table(logits.index_select(0, upload(index, device)), upload(targets, device), k).flatten()


def take_prompt_scores(scoring: list[tuple[Scheduled, int]], values: list[float]) -> None:
    """``prompt_scores`` read back, into each sequence's ``ctx.prompt_logprobs`` by position
    (a part recomputed after a preemption writes the same values again)."""
    k = max(item.seq.ctx.request.prompt_logprobs for item, _ in scoring)
    width, at = 1 + 2 * k, 0
    for item, _ in scoring:
        seq = item.seq
        for position in (p + 1 for p in scoring_positions(item)):
            lp, top = logprobs.unpack(values[at : at + width], k, seq.ctx.request.prompt_logprobs)
            seq.ctx.prompt_logprobs[position] = TokenLogprob(seq.ids[position], lp, top)
            at += width
