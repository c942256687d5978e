"""Log-probabilities of generated tokens (``Request.logprobs``) and prompt tokens
(``Request.prompt_logprobs``): equal to a plain transformers forward's log-softmax at each
position (the oracle), batched with other requests, with the prompt in the prefix cache, in
chunks, with an image in the prompt; read with the step's tokens in one transfer."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import logprob_oracle
from pipeline import Pipeline, Request, UserError
from pipeline.spec import Speculative
from stages import DecodeLoop, Prefill, Sampler, Tokenize, VisionEncoder


def engine(lm, **kwargs) -> Pipeline:
    return Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(**kwargs)}, kv_memory=16 << 20, max_seqs=8)


def oracle(lm, ids: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of a plain forward over prompt + generated: row j predicts generated[j]."""
    return logprob_oracle(lm, ids + generated[:-1])[len(ids) - 1 :]


def assert_matches(entries, generated: list[int], reference: torch.Tensor, k: int) -> None:
    assert [e.token_id for e in entries] == generated
    for j, e in enumerate(entries):
        assert e.logprob == pytest.approx(float(reference[j, generated[j]]), abs=1e-4)
        values, ids = reference[j].topk(k)
        assert [t for t, _ in e.top] == ids.tolist() or k == 0
        assert [v for _, v in e.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_generated_logprobs_match_a_plain_forward_batched_and_cached(load_tiny, family):
    lm = load_tiny(family)
    pipe = engine(lm)
    prompts = [list(range(5, 40)), list(range(7, 19)), list(range(5, 40)) + [60, 61]]  # the third: a cache hit
    asks = [5, None, 0]
    for wave in range(2):  # the second wave starts from the prefix cache
        handles = [
            pipe.submit(Request(max_new_tokens=6, ignore_eos=True, logprobs=k), ids=p) for p, k in zip(prompts, asks)
        ]
        results = [h.result() for h in handles]
        for p, k, r in zip(prompts, asks, results):
            if k is None:
                assert r.logprobs is None and "logprobs" not in r.to_dict()
                continue
            assert_matches(r.logprobs, r.token_ids, oracle(lm, p, r.token_ids), k)
            assert len(r.to_dict()["logprobs"]) == 6
    assert pipe.engine.counters["blocking_transfers_step_max"] <= 2  # read with the tokens, not after them


def test_asking_for_logprobs_leaves_the_tokens_unchanged(load_tiny):
    lm = load_tiny("qwen3")
    pipe = engine(lm)
    ids = list(range(9, 30))
    plain = pipe.run_ids(ids, Request(max_new_tokens=10, ignore_eos=True)).generated
    asked = pipe.run_ids(ids, Request(max_new_tokens=10, ignore_eos=True, logprobs=20)).generated
    sampled = [
        pipe.run_ids(
            ids, Request(max_new_tokens=10, ignore_eos=True, logprobs=k, sampler=Sampler(temperature=0.9, seed=3))
        ).generated
        for k in (None, 4)
    ]
    assert asked == plain and sampled[0] == sampled[1]


def test_raw_is_the_models_distribution_and_processed_what_the_sampler_drew_from(load_tiny):
    lm = load_tiny("qwen3")
    pipe = engine(lm)
    ids = list(range(11, 31))
    sampler = Sampler(temperature=0.7, top_k=3, seed=0)
    raw = pipe.run_ids(ids, Request(max_new_tokens=4, ignore_eos=True, logprobs=5, sampler=sampler))
    assert_matches(raw.logprobs, raw.generated, oracle(lm, ids, raw.generated), 5)
    processed = pipe.run_ids(
        ids, Request(max_new_tokens=4, ignore_eos=True, logprobs=5, sampler=sampler, logprobs_mode="processed")
    )
    assert processed.generated == raw.generated  # same seed, same draws
    reference = oracle(lm, ids, raw.generated)
    for j, e in enumerate(processed.logprobs):
        kept = (reference[j] / 0.7).topk(3)
        expected = (kept.values - torch.logsumexp(kept.values, 0)).tolist()
        assert [t for t, _ in e.top[:3]] == kept.indices.tolist()
        assert [v for _, v in e.top[:3]] == pytest.approx(expected, abs=1e-4)
        assert all(v == -math.inf for _, v in e.top[3:])  # removed by top_k
    written = json.dumps(processed.logprobs[0].to_dict(), allow_nan=False)  # result.json stays strict JSON
    assert json.loads(written)["top_logprobs"][3][1] == -9999.0


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_prompt_logprobs_match_a_plain_forward_though_the_prompt_is_cached(load_tiny, family):
    """Scored prompts are computed whole (the prefix cache holds them, and another request next
    to them uses it), in 16-token chunks next to other rows; the first position has no score."""
    lm = load_tiny(family)
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=16 << 20, max_batch_tokens=16)
    ids = list(range(5, 45))
    pipe.run_ids(ids, Request(max_new_tokens=2))  # now in the prefix cache
    scored = pipe.submit(Request(max_new_tokens=3, ignore_eos=True, prompt_logprobs=3), ids=ids)
    reusing = pipe.submit(Request(max_new_tokens=3, ignore_eos=True), ids=ids + [50])
    r = scored.result()
    assert reusing.result().metrics["kv_reused_tokens"] > 0 and r.metrics["kv_reused_tokens"] == 0
    reference = logprob_oracle(lm, ids)
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(ids) and r.logprobs is None
    assert_matches(r.prompt_logprobs[1:], ids[1:], reference[:-1], 3)
    assert r.to_dict()["prompt_logprobs"][0] is None


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_scoring_from_a_position_reuses_the_shared_context(load_tiny, family):
    """What a multiple-choice question runs: its choices score only their continuation, so the
    question's context comes from the prefix cache after the first; chunks of 16 tokens split
    the scored part (a part starting before the first scored position keeps only what scores)."""
    lm = load_tiny(family)
    pipe = Pipeline(lm, {"prefill": Prefill()}, kv_memory=16 << 20, max_batch_tokens=16)
    context = list(range(5, 55))
    choices = [[60, 61, 62], [70, 71], list(range(80, 100)), [90]]
    results = [
        pipe.run_ids(context + c, Request(prompt_logprobs=1, prompt_logprobs_from=len(context))) for c in choices
    ]
    for c, ctx in zip(choices, results):
        reference = logprob_oracle(lm, context + c)
        assert sorted(ctx.prompt_logprobs) == list(range(len(context), len(context) + len(c)))
        assert_matches(
            [ctx.prompt_logprobs[p] for p in sorted(ctx.prompt_logprobs)], c, reference[len(context) - 1 : -1], 1
        )
    assert results[0].metrics.counters["kv_reused_tokens"] == 0
    assert all(ctx.metrics.counters["kv_reused_tokens"] >= 32 for ctx in results[1:])
    with pytest.raises(UserError, match="prompt_logprobs_from must be a prompt position from 1 to 52"):
        pipe.run_ids(context + [1, 2, 3], Request(prompt_logprobs=1, prompt_logprobs_from=53))


def test_a_prefill_only_chain_scores_prompts(load_tiny):
    """What evaluation runs: no decode stage, several prompts scored in one step."""
    lm = load_tiny("qwen3")
    pipe = engine(lm).with_stages({"prefill": Prefill()})
    prompts = [list(range(5, 25)), list(range(30, 41)), list(range(5, 19))]
    handles = [pipe.submit(Request(prompt_logprobs=0), ids=p) for p in prompts]
    for p, h in zip(prompts, handles):
        reference = logprob_oracle(lm, p)
        assert_matches(h.result().prompt_logprobs[1:], p[1:], reference[:-1], 0)


def media_request(kind: str, **kwargs) -> Request:
    from PIL import Image

    if kind == "image":
        return Request(prompt="What colour?", images=[Image.new("RGB", (56, 56), (200, 30, 30))], **kwargs)
    t = torch.arange(32000, dtype=torch.float64) / 16000  # 2 s of a 440 Hz tone at 16 kHz
    return Request(
        prompt="What do you hear?", audios=[((0.4 * torch.sin(2 * torch.pi * 440 * t)).float(), 16000)], **kwargs
    )


@pytest.mark.parametrize("family, kind", [("qwen2-vl", "image"), ("qwen2-audio", "audio")])
def test_logprobs_with_media_in_the_prompt(load_tiny, family, kind):
    """Generated and prompt tokens scored with an image or audio clip in the prompt; then the
    same prompt again scoring only its last tokens, its start (the media) from the prefix cache."""
    from stages import AudioEncoder

    lm = load_tiny(family)
    encoder = {"vision": VisionEncoder()} if kind == "image" else {"audio": AudioEncoder()}
    pipe = Pipeline(
        lm, {"tokenize": Tokenize(), **encoder, "prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=16 << 20
    )
    ctx = pipe.run_context(media_request(kind, max_new_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1))
    prompt = ctx.input_ids[0].tolist()
    ids = prompt + ctx.generated[:-1]
    inputs = {k: v for k, v in ctx.model_inputs.items() if isinstance(v, torch.Tensor) and k != "input_ids"}
    inputs["attention_mask"] = torch.ones(1, len(ids), dtype=torch.long)
    if "mm_token_type_ids" in inputs:  # per prompt token: the generated ones are text
        types = inputs["mm_token_type_ids"]
        inputs["mm_token_type_ids"] = torch.cat([types, types.new_zeros(1, len(ids) - types.shape[1])], 1)
    logits = logprob_oracle(lm, ids, **inputs)
    assert_matches(ctx.logprobs, ctx.generated, logits[len(prompt) - 1 :], 2)
    assert_matches([ctx.prompt_logprobs[p] for p in range(1, len(prompt))], prompt[1:], logits[: len(prompt) - 1], 1)
    start = len(prompt) - 3
    again = pipe.run_context(media_request(kind, max_new_tokens=1, prompt_logprobs=1, prompt_logprobs_from=start))
    assert again.metrics.counters["kv_reused_tokens"] >= 16 and sorted(again.prompt_logprobs) == [
        start,
        start + 1,
        start + 2,
    ]
    assert_matches(
        [again.prompt_logprobs[p] for p in range(start, len(prompt))],
        prompt[start:],
        logits[start - 1 : len(prompt) - 1],
        1,
    )


@pytest.mark.parametrize("bad", [21, -1, True, 2.5])
def test_a_bad_logprobs_value_is_refused_and_others_finish(load_tiny, bad):
    pipe = engine(load_tiny("qwen3"))
    other = pipe.submit(Request(max_new_tokens=3, ignore_eos=True), ids=[5, 6, 7])
    with pytest.raises(UserError, match="logprobs must be a whole number from 0 to 20"):
        pipe.run_ids([5, 6, 7], Request(max_new_tokens=3, logprobs=bad))
    with pytest.raises(UserError, match="prompt_logprobs must be a whole number from 0 to 20"):
        pipe.run_ids([5, 6, 7], Request(max_new_tokens=3, prompt_logprobs=bad))
    assert len(other.result().token_ids) == 3


def test_logprobs_mode_and_speculative_decoding_are_checked(load_tiny):
    lm = load_tiny("qwen3")
    with pytest.raises(UserError, match="logprobs_mode must be one of raw, processed"):
        engine(lm).run_ids([5, 6, 7], Request(max_new_tokens=3, logprobs=1, logprobs_mode="sampled"))
    spec = engine(lm, speculative=Speculative("ngram", num_draft=2))
    with pytest.raises(UserError, match="speculative decoding"):
        spec.run_ids([5, 6, 7], Request(max_new_tokens=3, logprobs=1))


def test_engine_penalties_count_generated_tokens_and_match_a_plain_loop(load_tiny):
    """Presence and frequency penalties and a logit bias in the engine (batched with a plain
    row): the tokens of a plain greedy loop that applies vLLM's arithmetic to the tokens
    generated so far (not the prompt's)."""
    lm = load_tiny("qwen3")
    pipe = engine(lm)
    ids = list(range(5, 25))
    settings = dict(presence_penalty=1.5, frequency_penalty=0.8, logit_bias={7: 3.0})
    plain = pipe.submit(Request(max_new_tokens=8, ignore_eos=True), ids=ids)
    got = pipe.submit(Request(max_new_tokens=8, ignore_eos=True, sampler=Sampler(**settings)), ids=ids)
    out: list[int] = []
    for _ in range(8):
        x = logprob_oracle(lm, ids + out)[-1]  # log-softmax: the logits shifted, the same argmax
        x[7] += 3.0
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[0]).float()
        out.append(int((x - 0.8 * counts - 1.5 * (counts > 0).float()).argmax()))
    assert got.result().token_ids == out
    assert plain.result().token_ids == pipe.run_ids(ids, Request(max_new_tokens=8, ignore_eos=True)).generated


def test_a_logit_bias_outside_the_vocabulary_fails_that_request_alone(load_tiny):
    pipe = engine(load_tiny("qwen3"))
    other = pipe.submit(Request(max_new_tokens=3, ignore_eos=True), ids=[5, 6, 7])
    with pytest.raises(UserError, match=r"logit_bias names token ids \[99999\] outside the model's vocabulary"):
        pipe.run_ids([5, 6, 7], Request(max_new_tokens=3, sampler=Sampler(logit_bias={99999: 1.0})))
    assert len(other.result().token_ids) == 3
