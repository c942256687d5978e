"""The step's post-process phase: what a forward or a decode burst produced, into each sequence.

A forward's logits rows come in plan order, each part's ``1 + drafts`` rows when it ends at the
known tokens (none for a prefill chunk before the prompt's end). Each row goes where its part
says (``_sort``): a sequence that chooses its next token, one that verifies its drafts, a
prefill-only sequence that keeps its logits and ends, and the prompt rows of a request that
scores its prompt. The chosen tokens are read back first, in one transfer: that read is the
step's one wait for the device, and it ends the step's timing. Then the host side: the fed
tokens' cache keys and metrics, each chosen token taken (stream, stop checks, hooks), the
verified drafts kept or rolled back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch

from pipeline.context import TokenLogprob
from pipeline.engine import ends, pooling, token_choice
from pipeline.engine.intake import chosen_rows, kept_rows, prompt_rows
from pipeline.engine.scheduler import Scheduled, Scheduler
from pipeline.engine.sequence import Sequence
from pipeline.runner import ModelRunner, StepOutput, grammar
from pipeline.sampling import verify
from pipeline.transfer import read, wait


def count_step(counters: dict[str, int], tokens_in: int, used_blocks: int) -> None:
    """One model step in the engine's counters: steps, tokens fed, the pool's peak."""
    counters["steps"] += 1
    counters["tokens_in"] += tokens_in
    counters["kv_blocks_peak"] = max(counters["kv_blocks_peak"], used_blocks)


@dataclass
class _Rows:
    """Where a forward's logits rows go (``_sort``)."""

    choosing: list[Sequence] = field(default_factory=list)  # sequences choosing one token ...
    rows: list[int] = field(default_factory=list)  # ... from these rows
    verifying: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)  # rows after each draft
    recorded: list[Scheduled] = field(default_factory=list)  # parts whose fed tokens are recorded now
    ending: list[Sequence] = field(default_factory=list)  # prefill-only sequences, their logits kept
    scoring: list[tuple[Scheduled, int]] = field(default_factory=list)  # parts scoring their prompt, first row


class PostProcess:
    """Takes each step's output into its sequences; ends those that finish or fail."""

    def __init__(self, scheduler: Scheduler, counters: dict[str, int], runner: ModelRunner) -> None:
        self.scheduler, self.counters, self.runner = scheduler, counters, runner

    def __call__(self, plan: list[Scheduled], out: StepOutput) -> None:
        if out.tokens is not None:
            self._take_burst(plan, out)
            return
        parts = _sort(plan, out.logits)
        picked, scores = self._read_back(parts, out.logits)
        out.finish_timing()
        if parts.scoring:
            token_choice.take_prompt_scores(parts.scoring, scores)
        for item, row in zip(plan, out.pooled or ()):  # embeddings: a row per part that pools
            if row is not None:
                pooling.add(item.seq.ctx, row, item.begin)
        for item in parts.recorded:
            self._record_fed(item, out)
        for seq in parts.ending:
            ends.finish(self.scheduler, seq)
        if picked is not None:
            self.take_chosen(parts.choosing, *picked[:3])
        for seq, seq_logits in parts.verifying:
            self._verify(seq, seq_logits, out.seconds)

    def _read_back(self, parts: _Rows, logits: torch.Tensor) -> tuple[tuple | None, list[float] | None]:
        """The chosen tokens (``token_choice.pick``) and the prompt scores, in one read; or one
        wait for the device when the step chooses nothing."""
        scores = token_choice.prompt_scores(parts.scoring, logits)
        if parts.choosing:
            rows = logits if len(parts.rows) == logits.shape[0] else logits[parts.rows]
            picked = token_choice.pick(parts.choosing, rows, scores)
            return picked, picked[3]
        if scores is not None:
            return None, read(scores)
        wait(self.runner.device)
        return None, None

    def choose_and_take(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Choose and take one token per sequence (a sequence handed over with its prefill logits)."""
        self.take_chosen(seqs, *token_choice.pick(seqs, logits)[:3])

    def take_chosen(
        self, seqs: list[Sequence], tokens: list[int], sample_s: float, scored: Seq[TokenLogprob | None] = ()
    ) -> None:
        """The host side of one chosen token per sequence: record, stream, hooks, finish."""
        self.counters["tokens_out"] += len(tokens)
        for i, (seq, token_id) in enumerate(zip(seqs, tokens)):
            seq.ctx.metrics.add_span("sample", sample_s, 1)
            if i < len(scored) and scored[i] is not None:
                seq.ctx.logprobs.append(scored[i])
            try:
                reason = token_choice.take(seq, int(token_id))
            except BaseException as err:  # its streaming callback or hook raised (Ctrl-C in a chat): it ends
                ends.fail(self.scheduler, seq, err)
                continue
            if reason is not None:
                seq.ctx.finish_reason = reason
                ends.finish(self.scheduler, seq)

    def _record_fed(self, item: Scheduled, out: StepOutput) -> None:
        """The fed tokens' keys into the cache, and the step's time as prefill or decode."""
        seq = item.seq
        seq.cache.append(seq.keys[item.begin : item.end])
        m = seq.ctx.metrics
        if item.begin < seq.prompt_len or item.end - item.begin > 1:
            m.add_span("prefill", out.seconds, 1)
            m.count("prefill_tokens", item.end - item.begin)
        else:
            m.add_span("decode", out.seconds, 1)
            m.info["decode_compiled"] = out.compiled or bool(m.info.get("decode_compiled"))
            m.info["decode_cuda_graphs"] = out.graphed or bool(m.info.get("decode_cuda_graphs"))

    def _take_burst(self, plan: list[Scheduled], out: StepOutput) -> None:
        """A burst's tokens, step by step. A row that ends inside the burst (EOS, a stop string)
        had its later tokens computed for nothing; they are dropped, and so are their slots
        (``ends.finish`` trims)."""
        alive = list(enumerate(plan))
        for row_tokens in out.tokens:
            count_step(self.counters, len(alive), self.runner.pool.used_blocks)
            for _, item in alive:
                self._record_fed(Scheduled(item.seq, item.seq.cache.length, item.seq.cache.length + 1, []), out)
            self.take_chosen([item.seq for _, item in alive], [row_tokens[row] for row, _ in alive], 0.0)
            alive = [(row, item) for row, item in alive if not item.seq.done]
            if not alive:
                break

    def _verify(self, seq: Sequence, logits: torch.Tensor, seconds: float) -> None:
        """Keep the accepted drafts and one token of the target's own; roll the cache back past
        the rejected drafts (the forward wrote all of them)."""
        spec, m = seq.spec, seq.ctx.metrics
        drafts, checked, q = spec.drafts, spec.drafts, spec.q
        t0 = time.perf_counter()
        logits = token_choice.hold_ends(logits, [(i, seq, len(seq.ctx.generated) + i) for i in range(len(logits))])
        if seq.grammar is not None:  # drafts the grammar refuses are never kept: check only the rest
            n = seq.grammar.allowed_drafts(drafts)
            checked, q = drafts[:n], None if q is None else q[:n]
            logits = grammar.mask_rows(logits[: n + 1], [(i, seq.grammar, drafts[:i]) for i in range(n + 1)])
        tokens, accepted = verify(seq.sampler, logits, checked, q, seq.ids, seq.ctx.generated)
        sample_s = time.perf_counter() - t0
        seq.cache.append([seq.keys[seq.cache.length]] + drafts)
        seq.cache.rollback(seq.cache.length - (len(drafts) - accepted))
        spec.drafts, spec.q = [], None
        m.add_span("decode", seconds, 1)
        m.count("spec_drafted", len(drafts))
        m.count("spec_accepted", accepted)
        for token in tokens:
            self.take_chosen([seq], [token], sample_s)
            sample_s = 0.0
            if seq.done:
                break


def _sort(plan: list[Scheduled], logits: torch.Tensor) -> _Rows:
    """Each part's rows (``kept_rows`` of them, in plan order) to where they go; the choosing
    rows are the part's last."""
    parts, row = _Rows(), 0
    for item in plan:
        seq, n = item.seq, chosen_rows(item)
        if prompt_rows(item):
            parts.scoring.append((item, row))
        first = row + kept_rows(item) - n
        if seq.drafts:
            parts.verifying.append((seq, logits[first : first + n]))
        else:
            parts.recorded.append(item)
            if n and seq.prefill_only:
                seq.ctx.logits = logits[first : first + 1]
                parts.ending.append(seq)
            elif n:
                parts.choosing.append(seq)
                parts.rows.append(first)
        row += kept_rows(item)
    return parts
