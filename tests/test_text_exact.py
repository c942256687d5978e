"""Greedy output equals transformers' generate(do_sample=False), token for token (text families)."""

from __future__ import annotations

import pytest
import torch

from conftest import generate_oracle
from pipeline import Pipeline, Request
from stages import AudioEncoder, DecodeLoop, Prefill, Sampler, Tokenize

FAMILIES = ["qwen3", "llama"]
N = 12


def make_pipe(lm, sampler=None) -> Pipeline:
    return Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop(sampler or Sampler())})


def oracle_ids(lm, messages, **template_kwargs) -> torch.Tensor:
    ids = lm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True, **template_kwargs
    )["input_ids"]
    return ids.to(lm.device)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_prompt_matches_generate(load_tiny, family):
    lm = load_tiny(family)
    result = make_pipe(lm).run(Request(prompt="Tell me about the sea.", max_new_tokens=N))
    ids = oracle_ids(lm, [{"role": "user", "content": "Tell me about the sea."}])
    assert result.prompt_ids == ids[0].tolist()  # exactly one user message, the model's own template
    assert result.token_ids == generate_oracle(lm, ids, N)


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_with_system_prompt_matches_generate(load_tiny, family):
    lm = load_tiny(family)
    messages = [
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count to five."},
    ]
    result = make_pipe(lm).run(Request(messages=messages, system_prompt="Be brief.", max_new_tokens=N))
    ids = oracle_ids(lm, [{"role": "system", "content": "Be brief."}] + messages)
    assert result.prompt_ids == ids[0].tolist()
    assert result.token_ids == generate_oracle(lm, ids, N)


def test_thinking_switch_reaches_the_template(load_tiny):
    lm = load_tiny("qwen3")
    pipe = make_pipe(lm)
    on = pipe.run(Request(prompt="Why?", thinking=True, max_new_tokens=2))
    off = pipe.run(Request(prompt="Why?", thinking=False, max_new_tokens=N))
    ids = oracle_ids(lm, [{"role": "user", "content": "Why?"}], enable_thinking=False)
    assert off.prompt_ids == ids[0].tolist() != on.prompt_ids
    assert off.token_ids == generate_oracle(lm, ids, N)


def test_ignore_eos_generates_exactly_max_new_tokens(load_tiny):
    lm = load_tiny("qwen3")
    eos = sorted(lm.eos_token_ids)[0]
    # Make EOS the greedy choice at once: without ignore_eos the answer is one token long.
    with torch.no_grad():
        bias = torch.zeros(lm.model.lm_head.out_features)
        bias[eos] = 1e4
        lm.model.lm_head.bias = torch.nn.Parameter(bias)
    try:
        short = make_pipe(lm).run(Request(prompt="Hi", max_new_tokens=N))
        full = make_pipe(lm).run(Request(prompt="Hi", max_new_tokens=N, ignore_eos=True))
    finally:
        lm.model.lm_head.bias = None
    assert short.token_ids == [eos] and short.finish_reason == "eos"
    assert len(full.token_ids) == N and full.finish_reason == "length"


def test_stop_string_cuts_text_and_never_streams_it(load_tiny):
    lm = load_tiny("qwen3")
    free = make_pipe(lm).run(Request(prompt="Say something.", max_new_tokens=24, ignore_eos=True))
    text = free.text
    assert len(text) >= 6, "tiny model produced too little text for this test"
    stop = text[3:6]
    streamed: list[str] = []
    cut = make_pipe(lm).run(
        Request(prompt="Say something.", max_new_tokens=24, ignore_eos=True, stop=[stop]), on_text=streamed.append
    )
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.find(stop)]
    assert "".join(streamed) == cut.text


def test_streamed_text_equals_result_text(load_tiny):
    lm = load_tiny("llama")
    pieces: list[str] = []
    result = make_pipe(lm).run(Request(prompt="Stream please.", max_new_tokens=N), on_text=pieces.append)
    assert "".join(pieces) == result.text
    assert result.text == lm.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_seeded_sampling_reproduces_and_differs_by_seed(load_tiny):
    lm = load_tiny("qwen3")
    req = Request(prompt="Roll the dice.", max_new_tokens=N, ignore_eos=True)
    a = make_pipe(lm, Sampler(temperature=1.0, seed=1)).run(req).token_ids
    b = make_pipe(lm, Sampler(temperature=1.0, seed=1)).run(req).token_ids
    c = make_pipe(lm, Sampler(temperature=1.0, seed=2)).run(req).token_ids
    assert a == b and a != c


def test_metrics_contract(load_tiny):
    lm = load_tiny("qwen3")
    result = make_pipe(lm).run(Request(prompt="Metrics?", max_new_tokens=N, ignore_eos=True))
    m = result.metrics
    for stage in ("tokenize", "prefill", "decode", "sample"):
        assert m["stages"][stage]["seconds"] > 0
    assert m["stages"]["sample"]["calls"] == N
    assert m["stages"]["decode"]["calls"] == N - 1  # one engine step per decoded token
    assert m["generated_tokens"] == N and m["decode_tokens"] == N - 1
    assert m["prompt_tokens"] == len(result.prompt_ids) == m["prefill_tokens"] + m["kv_reused_tokens"]
    assert 0 < m["ttft_s"] < m["total_s"]
    assert m["tpot_s"] > 0 and m["prefill_tok_s"] > 0 and m["decode_tok_s"] > 0
    assert m["sample_s"] == m["stages"]["sample"]["seconds"]
    assert m["kv_cache_bytes"] > 0 and m["peak_memory_bytes"] > 0 and m["weights_bytes"] > 0
    assert m["bandwidth_gb_s"] > 0
    assert m["quant"] == "none"


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda v: Prefill(chunk_size=v), "prefill.chunk_size"),
        (lambda v: AudioEncoder(batch_size=v), "audio_encoder.batch_size"),
    ],
)
@pytest.mark.parametrize("value", [0, 1.5, True])
def test_stage_settings_must_be_whole_numbers(make, name, value):
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
        make(value)
