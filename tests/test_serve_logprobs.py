"""Log-probabilities over HTTP, read with the official ``openai`` client: chat's ``logprobs`` /
``top_logprobs`` (streamed and not), the legacy completions' ``logprobs`` with ``echo`` and
``max_tokens: 0``, prompts as token ids and as lists; vLLM's tokenizer endpoints; the sampling
fields; unimplemented fields refused. Every value equals a plain transformers forward's
log-softmax (the oracle) on the same weights."""

from __future__ import annotations

import httpx
import pytest
import torch
from openai import BadRequestError, OpenAI

from conftest import logprob_oracle


@pytest.fixture(scope="module")
def server(qwen3_server):  # shared with other files on this worker (conftest.py)
    qwen3_server.client = OpenAI(base_url=qwen3_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return qwen3_server


def greedy(lm, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """The greedy continuation and each step's log-probabilities."""
    out, rows = [], []
    for _ in range(n):
        row = logprob_oracle(lm, ids + out)[-1]
        rows.append(row)
        out.append(int(row.argmax()))
    return out, rows


def tokenize(server, **body) -> list[int]:
    return httpx.post(server.url + "/tokenize", json=body).json()["tokens"]


def test_chat_logprobs_streamed_or_not_match_the_oracle(server):
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = tokenize(server, messages=messages, add_generation_prompt=True)
    tokens, rows = greedy(server.lm, ids, 6)
    kwargs = dict(
        model="qwen3",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    whole = server.client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [
        item
        for chunk in server.client.chat.completions.create(**kwargs, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content
    ]
    assert len(whole) == 6 and [c.token for c in streamed] == [c.token for c in whole]
    texts = [server.lm.tokenizer.decode([t]) for t in tokens]
    for item, again, token, text, row in zip(whole, streamed, tokens, texts, rows):
        assert item.token == text and again.bytes == item.bytes
        assert item.bytes == list(text.encode()) or "\ufffd" in text  # a piece of a character: its own bytes
        assert item.logprob == pytest.approx(float(row[token]), abs=1e-4) == again.logprob
        top = row.topk(3)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [t.token for t in item.top_logprobs] == [server.lm.tokenizer.decode([t]) for t in top.indices.tolist()]
    plain = server.client.chat.completions.create(model="qwen3", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completions_echo_scores_the_prompt_given_as_ids(server):
    ids = tokenize(server, prompt="The sea is blue and the sky is", add_special_tokens=False)
    reference = logprob_oracle(server.lm, ids)
    scored = server.client.completions.create(model="qwen3", prompt=ids, echo=True, logprobs=1, max_tokens=0)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == server.lm.tokenizer.decode(ids) and choice.finish_reason == "length"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[1:] == pytest.approx(
        [float(reference[p - 1, ids[p]]) for p in range(1, len(ids))], abs=1e-4
    )
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    # lm-eval's loglikelihood request: text prompts in a list, max_tokens 1; one choice per prompt, in order
    texts = ["The sea is blue", "Two plus two is"]
    both = server.client.completions.create(
        model="qwen3", prompt=texts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    assert [c.index for c in both.choices] == [0, 1]
    for text, c in zip(texts, both.choices):
        assert c.text.startswith(text) and len(c.logprobs.tokens) == len(tokenize(server, prompt=text)) + 1
    assert both.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_logprobs_without_echo_and_the_cache_count(server):
    prompt = "Once upon a time there was a small red fox who lived"
    ids = tokenize(server, prompt=prompt)
    tokens, rows = greedy(server.lm, ids, 4)
    first = server.client.completions.create(
        model="qwen3", prompt=prompt, max_tokens=4, logprobs=2, temperature=0, extra_body={"ignore_eos": True}
    )
    lp = first.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([float(r[t]) for r, t in zip(rows, tokens)], abs=1e-4)
    assert [len(top) for top in lp.top_logprobs] == [2] * 4
    again = server.client.completions.create(model="qwen3", prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache held its blocks


def test_tokenizer_endpoints_in_vllms_shapes(server):
    tokenizer = server.lm.tokenizer
    got = httpx.post(server.url + "/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert got["tokens"] == tokenizer("hello world")["input_ids"] and got["count"] == len(got["tokens"])
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"]) and got["max_model_len"] > 0
    back = httpx.post(server.url + "/detokenize", json={"tokens": got["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(got["tokens"])}
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"]
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]


def test_sampling_fields_reach_the_sampler(server):
    """A +100 logit bias decides every token; penalties are accepted per request."""
    ids = tokenize(server, prompt="x", add_special_tokens=False)
    biased = server.client.completions.create(
        model="qwen3",
        prompt="Say something",
        max_tokens=3,
        temperature=0,
        logit_bias={str(ids[0]): 100},
        extra_body={"ignore_eos": True},
    )
    assert biased.choices[0].text == "x" * 3 or biased.choices[0].text == server.lm.tokenizer.decode(ids * 3)
    sampled = server.client.chat.completions.create(
        model="qwen3",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0.8,
        seed=1,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert sampled.choices[0].message.content is not None


@pytest.mark.parametrize(
    "body,named",
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format.type must be"),
        ({"tools": [], "frequency_penalty": 0}, "tools"),
        ({"logit_bias": {"99999999": 5}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ],
)
def test_bad_or_unimplemented_fields_are_a_400_naming_them(server, body, named):
    with pytest.raises(BadRequestError) as err:
        server.client.chat.completions.create(
            model="qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=body
        )
    assert err.value.status_code == 400 and named in err.value.message
    ok = server.client.chat.completions.create(
        model="qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="someone", metadata={"a": "b"}
    )
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_completions_refuse_negative_logprobs_and_max_tokens_0_without_echo(server):
    for body, named in (({"logprobs": -1}, "logprobs"), ({"max_tokens": 0}, "max_tokens=0")):
        response = httpx.post(server.url + "/v1/completions", json={"model": "qwen3", "prompt": "hi", **body})
        assert response.status_code == 400 and named in response.json()["error"]["message"]
