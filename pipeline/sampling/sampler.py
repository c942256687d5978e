"""Sampler: picks the next token from logits, on the device, without a host sync.

The filters reproduce transformers' own logits processors op for op, in the order
`generate()` applies them (transformers 5.23, `GenerationMixin._get_logits_processor`):
repetition penalty, then temperature, top-k, top-p, min-p. So the kept set of tokens is
exactly the one transformers would keep, and a greedy run matches `generate(do_sample=False)`.

Drawing uses gpt-fast's trick (`multinomial_sample_one_no_sync`): with q ~ Exp(1),
argmax(p / q) is a sample from p, and nothing has to come back to the host.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipeline.transfer import upload

__all__ = ["Sampler"]

_CHOICE_METHODS = ("__call__", "filtered_logits", "_process", "_repetition_penalty")
_BATCH_METHODS = _CHOICE_METHODS + ("draw", "choose_rows")


def _bias(value: Mapping[Any, float] | None) -> dict[int, float]:
    """``logit_bias`` checked: token id (an int, or its decimal string as JSON keys are) -> a bias
    in [-100, 100], added to that token's logit."""
    out = {}
    for key, bias in dict(value or {}).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"sampler logit_bias keys must be token ids, got {key!r}") from None
        if token < 0 or isinstance(key, bool):
            raise ValueError(f"sampler logit_bias keys must be token ids, got {key!r}")
        out[token] = _number(f"logit_bias[{token}]", bias, "in [-100, 100]")
        if not -100.0 <= out[token] <= 100.0:
            raise ValueError(f"sampler logit_bias[{token}] must be in [-100, 100], got {bias!r}")
    return out


def _number(name: str, value: object, rule: str) -> float:
    """Coerce a config value to float, or say which setting is wrong and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"sampler {name} must be a number {rule}, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"sampler {name} must be a finite number {rule}, got {value!r}")
    return value


class Sampler:
    """Next-token choice: greedy when temperature is 0, otherwise filtered sampling.

    Callable on plain logits, `[B, V]` -> `[B]` or `[V]` -> scalar tensor, so it can be
    reused outside the pipeline. Every setting at its neutral value skips its kernel.
    """

    def __init__(
        self,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
    ) -> None:
        self.temperature = _number("temperature", temperature, ">= 0 (0 means greedy)")
        if self.temperature < 0:
            raise ValueError(f"sampler temperature must be >= 0 (0 means greedy), got {temperature!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, float)) or top_k != int(top_k) or top_k < 0:
            raise ValueError(f"sampler top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
        self.top_k = int(top_k)
        self.top_p = _number("top_p", top_p, "in (0, 1] (1 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampler top_p must be in (0, 1] (1 disables it), got {top_p!r}")
        self.min_p = _number("min_p", min_p, "in [0, 1) (0 disables it)")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"sampler min_p must be in [0, 1) (0 disables it), got {min_p!r}")
        self.repetition_penalty = _number("repetition_penalty", repetition_penalty, "> 0 (1 disables it)")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"sampler repetition_penalty must be > 0 (1 disables it), got {repetition_penalty!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"sampler seed must be an integer or None, got {seed!r}")
        self.seed = seed
        # OpenAI's / vLLM's penalties over the tokens generated so far: minus presence_penalty once
        # for each token seen, minus frequency_penalty per time seen.
        self.presence_penalty = _number("presence_penalty", presence_penalty, "in [-2, 2] (0 disables it)")
        self.frequency_penalty = _number("frequency_penalty", frequency_penalty, "in [-2, 2] (0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"sampler {name} must be in [-2, 2] (0 disables it), got {getattr(self, name)!r}")
        self.logit_bias = _bias(logit_bias)
        # One generator per device, made on first use there: a CPU generator cannot feed CUDA kernels.
        self._generators: dict[torch.device, torch.Generator] = {}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """Choosing is a plain argmax: greedy, no penalty, and no method of the choice
        overridden. The engine then argmaxes such rows together with other requests' (and
        inside decode bursts) instead of calling the sampler; a subclass that changes how tokens
        are chosen is always called on its rows."""
        cls = type(self)
        return (
            self.greedy
            and not self.adjusts
            and all(getattr(cls, name) is getattr(Sampler, name) for name in _CHOICE_METHODS)
        )

    @property
    def adjusts(self) -> bool:
        """Whether some setting moves logits before the choice (a penalty or a bias): then even
        a greedy choice is not a plain argmax of the model's logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )

    @property
    def batchable(self) -> bool:
        """No method of the choice overridden: the engine chooses such rows together
        (``choose_rows``); a subclass that changes how tokens are chosen is called row by row."""
        cls = type(self)
        return all(getattr(cls, name) is getattr(Sampler, name) for name in _BATCH_METHODS)

    def __repr__(self) -> str:
        return (
            f"Sampler(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, "
            f"min_p={self.min_p}, repetition_penalty={self.repetition_penalty}, seed={self.seed}, "
            f"presence_penalty={self.presence_penalty}, frequency_penalty={self.frequency_penalty}, "
            f"logit_bias={self.logit_bias})"
        )

    def fork(self) -> "Sampler":
        """The same settings with a generator of its own, seeded afresh: one per sequence, so
        a seeded request draws the same tokens alone or in any batch."""
        other = copy.copy(self)
        other._generators = {}
        return other

    def reset(self) -> None:
        """Reseed, so that the same seed yields the same tokens again (seed=None: no-op)."""
        if self.seed is not None:
            for g in self._generators.values():
                g.manual_seed(self.seed)

    def _generator(self, device: torch.device) -> torch.Generator | None:
        """This sampler's generator on ``device``, made and seeded on first use there. Keyed by
        the device with its index (``cuda`` is ``cuda:<current>``): two generators for one GPU
        would both start from the seed and hand out the same random numbers twice."""
        if self.seed is None:
            return None  # global RNG state, like torch.manual_seed users expect
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    def filtered_logits(
        self,
        logits: Tensor,
        previous_ids: Tensor | Sequence[int] | None = None,
        output_ids: Tensor | Sequence[int] | None = None,
    ) -> Tensor:
        """Float32 logits after bias, penalties, temperature and filters; removed tokens are -inf.

        Same shape as `logits`. When greedy, only the bias and penalties apply (what argmax sees).
        ``previous_ids``: the ids so far (the repetition penalty's); ``output_ids``: the generated
        ones (presence and frequency penalties'; default ``previous_ids``).
        """
        squeeze = logits.dim() == 1
        scores = logits.unsqueeze(0) if squeeze else logits
        if scores.dim() != 2:
            raise ValueError(f"logits must be [B, V] or [V], got shape {tuple(logits.shape)}")
        scores = self._process(scores, previous_ids, output_ids)
        return scores.squeeze(0) if squeeze else scores

    def __call__(
        self,
        logits: Tensor,
        previous_ids: Tensor | Sequence[int] | None = None,
        output_ids: Tensor | Sequence[int] | None = None,
    ) -> Tensor:
        """Next token id per row: LongTensor [B] for [B, V] logits, a scalar tensor for [V]."""
        scores = self.filtered_logits(logits, previous_ids, output_ids)
        if self.greedy:
            return scores.argmax(dim=-1)
        return self.draw(torch.softmax(scores, dim=-1))

    @staticmethod
    def choose_rows(
        samplers: Sequence["Sampler"],
        logits: Tensor,
        history: Callable[[int], Sequence[int]],
        outputs: Callable[[int], Sequence[int]] | None = None,
    ) -> Tensor:
        """One token per row of ``logits`` [n, V], row i by ``samplers[i]``: the engine's batched
        choice. Each filter runs once for the whole batch with per-row settings (one top-k and
        one sort, not one per row); each row draws its noise from its own generator, so a seeded
        row gets the same token alone or in any batch. ``history(i)``: row i's ids so far, asked
        only of rows with a repetition penalty; ``outputs(i)``: its generated ids (default
        ``history``), asked only of rows with a presence or frequency penalty. Same tokens as
        calling each sampler on its row."""
        scores, device = logits.float(), logits.device
        if any(s.logit_bias for s in samplers):
            cells = [(i, t, b) for i, s in enumerate(samplers) for t, b in s.logit_bias.items()]
            scores = scores + _bias_rows(cells, scores, device)
        if any(s.repetition_penalty != 1.0 for s in samplers):
            ids = _padded([history(i) if s.repetition_penalty != 1.0 else [] for i, s in enumerate(samplers)], device)
            penalty = upload([[s.repetition_penalty] for s in samplers], device, dtype=torch.float32)
            scores = _penalise(scores, penalty, ids)
        counted = [s.presence_penalty != 0.0 or s.frequency_penalty != 0.0 for s in samplers]
        if any(counted):
            outputs = outputs or history
            ids = _padded([outputs(i) if c else [] for i, c in enumerate(counted)], device)
            weights = upload([[s.presence_penalty, s.frequency_penalty] for s in samplers], device, dtype=torch.float32)
            scores = _count_penalties(scores, weights[:, :1], weights[:, 1:], ids)
        sampling = [i for i, s in enumerate(samplers) if not s.greedy]
        if not sampling:
            return scores.argmax(dim=-1)
        index = None if len(sampling) == len(samplers) else upload(sampling, device)
        part = scores if index is None else scores.index_select(0, index)
        probs = torch.softmax(_filter(part, _Rows.of([samplers[i] for i in sampling], device)), dim=-1)
        noise = torch.empty_like(probs)
        for row, i in enumerate(sampling):
            noise[row].exponential_(1, generator=samplers[i]._generator(device))
        drawn = _argmax_over_noise(probs, noise)
        return drawn if index is None else scores.argmax(dim=-1).index_copy(0, index, drawn)

    def draw(self, probs: Tensor) -> Tensor:
        """One token per row of ``probs`` (any distribution, e.g. speculative decoding's residual),
        from this sampler's generator: seeded requests stay reproducible."""
        q = torch.empty_like(probs).exponential_(1, generator=self._generator(probs.device))
        return _argmax_over_noise(probs, q)

    def uniform(self, device: torch.device) -> float:
        """A U[0, 1) draw from this sampler's generator (speculative decoding's acceptance test)."""
        return float(torch.rand((), device=device, generator=self._generator(device)))

    def _process(
        self,
        scores: Tensor,
        previous_ids: Tensor | Sequence[int] | None,
        output_ids: Tensor | Sequence[int] | None = None,
    ) -> Tensor:
        scores = scores.float()  # no copy when already float32; every step below is out of place
        if self.logit_bias:
            scores = scores + _bias_rows([(0, t, b) for t, b in self.logit_bias.items()], scores[:1], scores.device)
        if self.repetition_penalty != 1.0 and previous_ids is not None:
            scores = self._repetition_penalty(scores, previous_ids)
        output_ids = previous_ids if output_ids is None else output_ids
        if (self.presence_penalty or self.frequency_penalty) and output_ids is not None:
            scores = _count_penalties(
                scores,
                self.presence_penalty,
                self.frequency_penalty,
                _rows_of(output_ids, scores.shape[0], scores.device),
            )
        if self.greedy:
            return scores
        return _filter(scores, _Rows.one(self))

    def _repetition_penalty(self, scores: Tensor, previous_ids: Tensor | Sequence[int]) -> Tensor:
        """RepetitionPenaltyLogitsProcessor: seen tokens get logit/p if positive, logit*p if negative.

        `previous_ids` is [B, T], or [T] shared by every row. Ids outside the vocabulary
        (negative padding, embedding rows beyond lm_head) are ignored, as in transformers.
        """
        return _penalise(scores, self.repetition_penalty, _rows_of(previous_ids, scores.shape[0], scores.device))


# -- the chain, on rows of one sampler or of many; each step is the same arithmetic as its
# transformers counterpart, and a row's neutral setting leaves its scores bit for bit unchanged.


@dataclass
class _Rows:
    """The filter settings of a batch's sampling rows: one number for all of them (one sampler),
    or [n, 1] columns uploaded together. ``top_k_max``: the largest k any row filters with (0:
    none); ``top_p``, ``min_p``: None when no row uses them."""

    temperature: float | Tensor
    top_k: int | Tensor
    top_k_max: int
    top_p: float | Tensor | None
    min_p: float | Tensor | None

    @classmethod
    def one(cls, s: Sampler) -> "_Rows":
        return cls(
            s.temperature, s.top_k, s.top_k, s.top_p if s.top_p < 1.0 else None, s.min_p if s.min_p > 0.0 else None
        )

    @classmethod
    def of(cls, samplers: Sequence[Sampler], device: torch.device) -> "_Rows":
        host = [[s.temperature, s.top_k, s.top_p, s.min_p] for s in samplers]
        t, k, p, m = (c[:, None] for c in upload(host, device, dtype=torch.float32).unbind(1))
        return cls(
            t,
            k.long(),
            max(s.top_k for s in samplers),
            p if any(s.top_p < 1.0 for s in samplers) else None,
            m if any(s.min_p > 0.0 for s in samplers) else None,
        )


def _filter(scores: Tensor, rows: _Rows) -> Tensor:
    """Temperature, top-k, top-p, min-p (generate()'s order) on float32 ``scores`` [n, V]."""
    if isinstance(rows.temperature, Tensor) or rows.temperature != 1.0:
        scores = scores / rows.temperature  # TemperatureLogitsWarper
    vocab = scores.shape[-1]
    if isinstance(rows.top_k, int):
        if 0 < rows.top_k < vocab:  # TopKLogitsWarper: ties with the k-th value are kept.
            scores = scores.masked_fill(scores < torch.topk(scores, rows.top_k)[0][..., -1, None], -math.inf)
    elif rows.top_k_max > 0:
        # A row's k-th largest value is the same in a top-k of any larger k; rows with k = 0
        # (or k >= V) keep everything.
        top = torch.topk(scores, min(rows.top_k_max, vocab))[0]
        kth = top.gather(1, rows.top_k.clamp(1, top.shape[-1]) - 1)
        kth = torch.where((rows.top_k > 0) & (rows.top_k < vocab), kth, -math.inf)
        scores = scores.masked_fill(scores < kth, -math.inf)
    if rows.top_p is not None:
        # TopPLogitsWarper: drop the low tail whose total mass is <= 1 - top_p; keep the top token.
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = (cumulative <= (1 - rows.top_p)) & (rows.top_p < 1.0)
        sorted_remove[..., -1:] = False
        remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
        scores = scores.masked_fill(remove, -math.inf)
    if rows.min_p is not None:
        # MinPLogitsWarper: drop tokens below min_p x the top probability (min_p 0: none). The top
        # token always survives (min_p < 1), so transformers' min_tokens_to_keep scatter is a no-op.
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < rows.min_p * probs.amax(dim=-1, keepdim=True), -math.inf)
    return scores


def _penalise(scores: Tensor, penalty: float | Tensor, ids: Tensor) -> Tensor:
    """RepetitionPenaltyLogitsProcessor on ``scores`` [n, V] with ``ids`` [n, T] (ids outside the
    vocabulary, padding included, go to one extra column that is dropped afterwards)."""
    vocab = scores.shape[-1]
    if ids.shape[1] == 0:
        return scores
    ids = ids.masked_fill(ids < 0, vocab).clamp(max=vocab)
    padded = torch.nn.functional.pad(scores, (0, 1))
    seen = torch.gather(padded, 1, ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    padded.scatter_(1, ids, seen)
    return padded[:, :vocab]


def _rows_of(ids: Tensor | Sequence[int], batch: int, device: torch.device) -> Tensor:
    """``previous_ids`` / ``output_ids`` as [B, T]: [T] is shared by every row."""
    ids = torch.as_tensor(ids, device=device).long()
    if ids.dim() == 1:
        ids = ids.unsqueeze(0).expand(batch, -1)
    if ids.dim() != 2 or ids.shape[0] != batch:
        raise ValueError(f"previous_ids must be [B, T] with B={batch} or [T], got shape {tuple(ids.shape)}")
    return ids


def _count_penalties(scores: Tensor, presence: float | Tensor, frequency: float | Tensor, ids: Tensor) -> Tensor:
    """OpenAI's presence and frequency penalties (vLLM's arithmetic): each token's logit minus
    ``frequency`` x its count in ``ids`` [n, T] and ``presence`` once if it is there at all (ids
    outside the vocabulary, padding included, are not counted)."""
    vocab = scores.shape[-1]
    if ids.shape[1] == 0:
        return scores
    ids = ids.masked_fill(ids < 0, vocab).clamp(max=vocab)
    counts = torch.zeros(scores.shape[0], vocab + 1, dtype=scores.dtype, device=scores.device)
    counts = counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=scores.dtype))[:, :vocab]
    return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)


def _bias_rows(cells: list[tuple[int, int, float]], scores: Tensor, device: torch.device) -> Tensor:
    """A [n, V] matrix of zeros with each (row, token, bias) of ``cells`` in place: ``logit_bias``
    for the rows of ``scores``, one upload."""
    vocab = scores.shape[-1]
    unknown = sorted({t for _, t, _ in cells if t >= vocab})
    if unknown:
        raise ValueError(f"logit_bias names token ids {unknown[:5]} outside the vocabulary of {vocab} tokens")
    bias = torch.zeros_like(scores)
    rows = upload([[r for r, _, _ in cells], [t for _, t, _ in cells]], device)
    return bias.index_put_((rows[0], rows[1]), upload([b for _, _, b in cells], device, dtype=scores.dtype))


def _padded(histories: list[Sequence[int]], device: torch.device) -> Tensor:
    """[n, T] ids, rows padded with -1 (outside the vocabulary): one upload for the batch."""
    width = max(len(h) for h in histories)
    return upload([list(h) + [-1] * (width - len(h)) for h in histories], device)


def _argmax_over_noise(probs: Tensor, q: Tensor) -> Tensor:
    """gpt-fast's draw: argmax(p / q) with q ~ Exp(1) is a sample from p, with no host sync."""
    # An Exp(1) draw of exactly 0 would turn a removed token's 0/0 into NaN, which argmax prefers.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)
