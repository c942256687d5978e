"""Sampler: same kept sets as transformers' processors, greedy = argmax, seeded and on-device draws."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from stages.sampler import Sampler

SHAPES = [(1, 7), (4, 50), (3, 1000)]


def _logits(shape: tuple[int, int], seed: int, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: many exact ties at every threshold
        return torch.randint(-4, 4, shape, generator=g).float() / 2
    return torch.randn(shape, generator=g) * 3


def _prev_ids(batch: int, vocab: int, seed: int, length: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(0, vocab, (batch, length), generator=g)


def _kept(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x)


def _assert_same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(_kept(ours), _kept(ref))
    keep = _kept(ref)
    torch.testing.assert_close(ours[keep], ref[keep].float(), rtol=1e-6, atol=1e-6)


CASES = [(shape, seed, ties) for shape in SHAPES for seed in (0, 1) for ties in (False, True)]


@pytest.mark.parametrize("shape,seed,ties", CASES)
@pytest.mark.parametrize("top_k", [1, 3, 10, 5000])
def test_top_k_matches_transformers(shape, seed, ties, top_k):
    x = _logits(shape, seed, ties)
    ours = Sampler(temperature=1.0, top_k=top_k).filtered_logits(x)
    _assert_same(ours, TopKLogitsWarper(top_k)(None, x.clone()))


@pytest.mark.parametrize("shape,seed,ties", CASES)
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_matches_transformers(shape, seed, ties, top_p):
    x = _logits(shape, seed, ties)
    ours = Sampler(temperature=1.0, top_p=top_p).filtered_logits(x)
    _assert_same(ours, TopPLogitsWarper(top_p)(None, x.clone()))


@pytest.mark.parametrize("shape,seed,ties", CASES)
@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 0.99])
def test_min_p_matches_transformers(shape, seed, ties, min_p):
    x = _logits(shape, seed, ties)
    ours = Sampler(temperature=1.0, min_p=min_p).filtered_logits(x)
    _assert_same(ours, MinPLogitsWarper(min_p)(None, x.clone()))


@pytest.mark.parametrize("shape,seed,ties", CASES)
@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_matches_transformers(shape, seed, ties, temperature):
    x = _logits(shape, seed, ties)
    ours = Sampler(temperature=temperature).filtered_logits(x)
    _assert_same(ours, TemperatureLogitsWarper(temperature)(None, x.clone()))


@pytest.mark.parametrize("shape,seed,ties", CASES)
@pytest.mark.parametrize("penalty", [0.7, 1.3])
def test_repetition_penalty_matches_transformers(shape, seed, ties, penalty):
    x = _logits(shape, seed, ties)
    ids = _prev_ids(shape[0], shape[1], seed)
    ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, x.clone())
    for sampler in (Sampler(repetition_penalty=penalty), Sampler(temperature=1.0, repetition_penalty=penalty)):
        ours = sampler.filtered_logits(x, ids)
        assert torch.equal(ours, ref)


def test_repetition_penalty_ignores_ids_outside_vocab():
    x = _logits((2, 20), 3)
    ids = torch.tensor([[1, 25, 3, 20], [19, 19, 0, 400]])
    ref = RepetitionPenaltyLogitsProcessor(1.5)(ids, x.clone())
    assert torch.equal(Sampler(repetition_penalty=1.5).filtered_logits(x, ids), ref)
    # Negative padding ids are ignored too (transformers would fail on them).
    padded = torch.tensor([[-100, 1, 25, 3, 20], [19, 19, 0, 400, -1]])
    assert torch.equal(Sampler(repetition_penalty=1.5).filtered_logits(x, padded), ref)


def test_repetition_penalty_1d_ids_and_list_apply_to_every_row():
    x = _logits((3, 30), 4)
    ids = [2, 5, 5, 29]
    ref = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([ids] * 3), x.clone())
    assert torch.equal(Sampler(repetition_penalty=1.2).filtered_logits(x, ids), ref)
    assert torch.equal(Sampler(repetition_penalty=1.2).filtered_logits(x, torch.tensor(ids)), ref)
    # Empty history changes nothing.
    assert torch.equal(Sampler(repetition_penalty=1.2).filtered_logits(x, torch.empty(3, 0, dtype=torch.long)), x)


CHAIN_SETTINGS = [
    dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    dict(temperature=1.5, top_k=0, top_p=0.5, min_p=0.0, repetition_penalty=0.8),
    dict(temperature=0.5, top_k=5, top_p=1.0, min_p=0.2, repetition_penalty=1.0),
    dict(temperature=1.0, top_k=3, top_p=0.3, min_p=0.5, repetition_penalty=1.1),
]


def _hf_chain(s: dict) -> LogitsProcessorList:
    """The warpers in the order transformers' _get_logits_processor appends them (do_sample=True)."""
    procs = LogitsProcessorList()
    if s["repetition_penalty"] != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(s["repetition_penalty"]))
    if s["temperature"] != 1.0:
        procs.append(TemperatureLogitsWarper(s["temperature"]))
    if s["top_k"]:
        procs.append(TopKLogitsWarper(s["top_k"]))
    if s["top_p"] < 1.0:
        procs.append(TopPLogitsWarper(s["top_p"]))
    procs.append(MinPLogitsWarper(s["min_p"]))
    return procs


@pytest.mark.parametrize("shape,seed,ties", CASES)
@pytest.mark.parametrize("settings", CHAIN_SETTINGS)
def test_chain_matches_transformers(shape, seed, ties, settings):
    x = _logits(shape, seed, ties)
    ids = _prev_ids(shape[0], shape[1], seed)
    ref = _hf_chain(settings)(ids, x.clone())
    _assert_same(Sampler(**settings).filtered_logits(x, ids), ref)


def test_low_precision_logits_are_processed_in_float32():
    x = _logits((2, 300), 5).to(torch.bfloat16)
    s = dict(temperature=0.7, top_k=50, top_p=0.8, min_p=0.02, repetition_penalty=1.3)
    ids = _prev_ids(2, 300, 5)
    ours = Sampler(**s).filtered_logits(x, ids)
    assert ours.dtype == torch.float32
    _assert_same(ours, _hf_chain(s)(ids, x.float()))
    assert Sampler(temperature=0.7, top_k=5, seed=0)(x).dtype == torch.long


def test_filtered_logits_leaves_input_untouched():
    x = _logits((2, 40), 6)
    before = x.clone()
    Sampler(temperature=0.5, top_k=4, top_p=0.5, min_p=0.1, repetition_penalty=1.5, seed=0)(x, _prev_ids(2, 40, 6))
    assert torch.equal(x, before)


@pytest.mark.parametrize("ties", [False, True])
def test_greedy_is_argmax(ties):
    x = _logits((5, 100), 7, ties)
    # Filters do not matter when greedy.
    for sampler in (Sampler(), Sampler(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9, seed=3)):
        assert torch.equal(sampler(x), x.argmax(dim=-1))
    ids = _prev_ids(5, 100, 7, length=40)
    ref = RepetitionPenaltyLogitsProcessor(1.8)(ids, x.clone()).argmax(dim=-1)
    assert torch.equal(Sampler(repetition_penalty=1.8)(x, ids), ref)
    assert not torch.equal(ref, x.argmax(dim=-1))  # the penalty did change something here


def test_1d_logits_give_a_scalar():
    x = _logits((1, 30), 8)[0]
    assert Sampler()(x).shape == ()
    assert Sampler()(x).item() == int(x.argmax())
    tok = Sampler(temperature=1.0, seed=0)(x, [1, 2, 3])
    assert tok.shape == () and tok.dtype == torch.long
    assert Sampler(temperature=1.0, top_k=3).filtered_logits(x).shape == (30,)


def _draws(sampler: Sampler, x: torch.Tensor, n: int = 50) -> list[int]:
    return [int(sampler(x)) for _ in range(n)]


def test_same_seed_same_tokens():
    x = torch.randn(200, generator=torch.Generator().manual_seed(9)) * 0.3  # flat-ish
    a = Sampler(temperature=1.0, top_p=0.95, seed=123)
    first = _draws(a, x)
    a.reset()
    assert _draws(a, x) == first
    assert _draws(Sampler(temperature=1.0, top_p=0.95, seed=123), x) == first
    assert len(set(first)) > 10  # really sampling, not stuck on one token
    assert _draws(Sampler(temperature=1.0, top_p=0.95, seed=124), x) != first


def test_one_generator_per_device_however_it_is_named():
    """``uniform("cpu")`` and ``uniform(torch.device("cpu"))`` (on a GPU: ``cuda`` and ``cuda:0``)
    draw from one seeded stream: two generators would replay the same numbers."""
    names = (
        ["cuda", torch.device("cuda", torch.cuda.current_device())]
        if torch.cuda.is_available()
        else ["cpu", torch.device("cpu")]
    )
    mixed = Sampler(temperature=1.0, seed=7)
    one = Sampler(temperature=1.0, seed=7)
    assert [mixed.uniform(names[0]), mixed.uniform(names[1])] == [one.uniform(names[1]), one.uniform(names[1])]


def test_unseeded_uses_global_rng():
    x = torch.randn(200, generator=torch.Generator().manual_seed(9)) * 0.3
    s = Sampler(temperature=1.0)
    torch.manual_seed(5)
    first = _draws(s, x)
    torch.manual_seed(5)
    assert _draws(s, x) == first


def test_sampling_respects_the_kept_set():
    x = _logits((4, 64), 10)
    s = Sampler(temperature=1.3, top_k=12, top_p=0.8, min_p=0.05, repetition_penalty=1.2, seed=1)
    ids = _prev_ids(4, 64, 10)
    kept = _kept(s.filtered_logits(x, ids))
    assert (~kept).any(dim=-1).all()
    seen = torch.zeros_like(kept)
    for _ in range(500):
        tok = s(x, ids)
        seen[torch.arange(4), tok] = True
    assert not (seen & ~kept).any()
    assert (seen.sum(-1) > 1).all()


def test_frequencies_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40_000
    s = Sampler(temperature=0.8, seed=2024)
    tokens = s(logits.expand(n, -1))  # one call, n independent rows
    freq = torch.bincount(tokens, minlength=6).float() / n
    expected = torch.softmax(logits / 0.8, dim=-1)
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)

    # With a filter, the mass is renormalised over the kept set.
    s = Sampler(temperature=1.0, top_k=3, seed=7)
    freq = torch.bincount(s(logits.expand(n, -1)), minlength=6).float() / n
    expected = torch.softmax(torch.cat([logits[:3], torch.full((3,), -math.inf)]), dim=-1)
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.0), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(seed="abc"), "seed"),
    ],
)
def test_invalid_settings_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Sampler(**kwargs)


def test_config_values_are_coerced():
    # Hydra overrides such as sampler.temperature=1 arrive as ints.
    s = Sampler(temperature=1, top_k=40.0, top_p=1, min_p=0, repetition_penalty=1, seed=0)
    assert isinstance(s.temperature, float) and isinstance(s.top_k, int) and s.top_k == 40
    assert "temperature=1.0" in repr(s)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampling_stays_on_device_without_sync():
    x = _logits((4, 32000), 11).cuda().to(torch.bfloat16)
    ids = _prev_ids(4, 32000, 11).cuda()
    s = Sampler(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, seed=0)
    first = s(x, ids)  # warm up: creates the generator, loads kernels (and takes the seed's first draw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        toks = [s(x, ids) for _ in range(5)]
        greedy = Sampler(repetition_penalty=1.1)(x, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(t.is_cuda and t.dtype == torch.long for t in toks)
    kept = _kept(s.filtered_logits(x, ids))
    assert all(kept[torch.arange(4, device="cuda"), t].all() for t in toks)
    s.reset()  # reseeded: the seed's first draw again (the warm-up's, not toks[0], the second)
    assert torch.equal(s(x, ids), first)
    assert torch.equal(greedy, RepetitionPenaltyLogitsProcessor(1.1)(ids, x.float()).argmax(-1))


BATCH_SETTINGS = CHAIN_SETTINGS + [
    dict(temperature=0.0, repetition_penalty=1.4),  # greedy with a penalty, next to sampling rows
    dict(temperature=0.9),
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.2, top_k=4000),  # k past the vocabulary: keeps everything
]


def _one_by_one(settings: list[dict], x: torch.Tensor, histories: list[list[int]]) -> list[int]:
    tokens = []
    for i, s in enumerate(settings):
        sampler = Sampler(**s, seed=100 + i)
        ids = torch.tensor([histories[i]]) if histories[i] else torch.empty(1, 0, dtype=torch.long)
        tokens.append(int(sampler(x[i : i + 1], ids)))
    return tokens


@pytest.mark.parametrize("ties", [False, True])
def test_rows_chosen_together_get_the_tokens_each_gets_alone(ties):
    """The engine's batched choice (one top-k, one sort for every row) against each row's own
    sampler: the same tokens, whatever the mix of settings, ties included."""
    settings = BATCH_SETTINGS * 3
    x = _logits((len(settings), 1000), 7, ties)
    histories = [_prev_ids(1, 1000, i, length=i % 5 * 4)[0].tolist() for i in range(len(settings))]
    samplers = [Sampler(**s, seed=100 + i) for i, s in enumerate(settings)]
    asked = []

    def history(i):
        asked.append(i)
        return histories[i]

    together = Sampler.choose_rows(samplers, x, history).tolist()
    assert together == _one_by_one(settings, x, histories)
    assert sorted(asked) == [i for i, s in enumerate(settings) if s.get("repetition_penalty", 1.0) != 1.0]


def test_a_seeded_row_draws_the_same_in_any_batch():
    x = _logits((6, 300), 8)
    alone = [
        int(Sampler.choose_rows([Sampler(temperature=1.0, top_p=0.95, seed=5)], x[i : i + 1], list)[0])
        for i in range(6)
    ]
    batch = Sampler.choose_rows([Sampler(temperature=1.0, top_p=0.95, seed=5) for _ in range(6)], x, list)
    assert batch.tolist() == alone


def test_a_subclass_that_changes_the_choice_is_not_batched():
    class Biased(Sampler):
        def _process(self, scores, previous_ids):
            return super()._process(scores, previous_ids) - torch.arange(scores.shape[-1])

    assert Sampler(temperature=0.7, top_k=3).batchable
    assert not Biased(temperature=0.7).batchable


def _counted(x: torch.Tensor, ids: list[int], presence: float, frequency: float) -> torch.Tensor:
    """vLLM's presence and frequency penalties, written out."""
    counts = torch.zeros(x.shape[-1])
    for t in ids:
        counts[t] += 1
    return x - frequency * counts - presence * (counts > 0).float()


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 1.5), (-1.0, 0.7)])
def test_presence_and_frequency_penalties_count_the_output_tokens(presence, frequency):
    x = _logits((1, 50), 9)
    prompt, output = [3, 3, 4], [7, 7, 7, 9]
    s = Sampler(presence_penalty=presence, frequency_penalty=frequency)
    got = s.filtered_logits(x, torch.tensor([prompt + output]), torch.tensor([output]))
    assert torch.allclose(got, _counted(x[0], output, presence, frequency)[None], atol=1e-6)
    assert not s.argmax_only


def test_logit_bias_moves_the_named_tokens():
    x = _logits((2, 40), 10)
    s = Sampler(logit_bias={"5": 100, 6: -100.0})
    got = s.filtered_logits(x)
    assert torch.equal(got[:, 5], x[:, 5] + 100) and torch.equal(got[:, 6], x[:, 6] - 100)
    assert torch.equal(got[:, 7:], x[:, 7:]) and (s(x) == 5).all() and not s.argmax_only
    with pytest.raises(ValueError, match="outside the vocabulary of 40 tokens"):
        Sampler(logit_bias={40: 1.0})(x)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(logit_bias={"x": 1}), "logit_bias keys"),
        (dict(logit_bias={1: 101}), r"logit_bias\[1\]"),
        (dict(logit_bias={-1: 1}), "logit_bias keys"),
    ],
)
def test_bad_penalties_and_biases_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Sampler(**kwargs)


def test_penalties_and_biases_chosen_together_equal_row_by_row():
    settings = [
        dict(temperature=0.8, presence_penalty=0.6, frequency_penalty=0.4, logit_bias={3: 2.0}),
        dict(temperature=0.0, frequency_penalty=1.2),
        dict(temperature=1.1, top_k=7),
        dict(temperature=0.0, logit_bias={11: 50.0}),
        dict(temperature=0.9, repetition_penalty=1.3, presence_penalty=-0.5),
    ] * 2
    x = _logits((len(settings), 300), 11)
    histories = [_prev_ids(1, 300, i, length=9)[0].tolist() for i in range(len(settings))]
    outputs = [h[4:] for h in histories]
    together = Sampler.choose_rows(
        [Sampler(**s, seed=i) for i, s in enumerate(settings)], x, lambda i: histories[i], lambda i: outputs[i]
    ).tolist()
    alone = [
        int(Sampler(**s, seed=i)(x[i : i + 1], torch.tensor([histories[i]]), torch.tensor([outputs[i]])))
        for i, s in enumerate(settings)
    ]
    assert together == alone
