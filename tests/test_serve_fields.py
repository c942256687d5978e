"""What clients of vLLM send, against a real server on the tiny Qwen3 (issue 50): the request
fields ``stop_token_ids``, ``min_tokens``, ``continue_final_message`` / ``add_generation_prompt``,
``reasoning_effort`` and ``priority`` honoured (each answer equal to the pipeline's own with the
same settings); a bounded queue (``serve.max_waiting``: 503 with Retry-After at once, never a
500, every accepted request complete); CORS for the configured origins only."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from pipeline import Pipeline, Request
from serving import serving_tiny
from stages import DecodeLoop, Prefill, Tokenize

ALLOWED = "http://app.example"
QUESTION = [{"role": "user", "content": "Tell me a story about the sea."}]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    overrides = ("engine.max_seqs=1", "serve.max_waiting=2", f"serve.cors_origins=[{ALLOWED}]")
    with serving_tiny(tmp_path_factory.mktemp("serve-fields"), tiny_dir("qwen3"), "qwen3", *overrides) as server:
        server.client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        stages = {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()}
        server.pipe = Pipeline(server.lm, stages, kv_memory=16 << 20)
        yield server


def chat(server, messages=QUESTION, **kw) -> str:
    answer = server.client.chat.completions.create(model="qwen3", messages=messages, temperature=0, **kw)
    return answer.choices[0].message.content


def local(server, messages=QUESTION, **fields):
    return server.pipe.run(Request(messages=messages, **fields))


def test_stop_token_ids_and_min_tokens_are_honoured(server):
    free = local(server, max_new_tokens=12, ignore_eos=True)
    stop = free.token_ids[3]
    cut = local(server, max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    body = {"ignore_eos": True, "stop_token_ids": [stop]}
    assert chat(server, max_tokens=12, extra_body=body) == cut.text != free.text
    held = local(server, max_new_tokens=12, ignore_eos=True, stop_token_ids=[free.token_ids[0]], min_new_tokens=5)
    body = {"ignore_eos": True, "stop_token_ids": [free.token_ids[0]], "min_tokens": 5}
    assert chat(server, max_tokens=12, extra_body=body) == held.text and len(held.token_ids) >= 5


def test_continue_final_message_continues_the_assistant(server):
    messages = QUESTION + [{"role": "assistant", "content": "Once upon a"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    expected = local(server, messages, max_new_tokens=6, **flags).text
    assert chat(server, messages, max_tokens=6, extra_body=flags) == expected
    wrong = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": messages, "continue_final_message": True},
        timeout=60,
    )
    assert wrong.status_code == 400 and "add_generation_prompt" in wrong.json()["error"]["message"]


def test_reasoning_effort_switches_the_templates_thinking(server):
    off = chat(server, max_tokens=8, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = chat(server, max_tokens=8, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert chat(server, max_tokens=8, reasoning_effort="minimal") == off
    assert chat(server, max_tokens=8, reasoning_effort="high") == on
    both = {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": True}, "messages": QUESTION}
    answer = httpx.post(server.url + "/v1/chat/completions", json=both, timeout=60)
    assert answer.status_code == 400 and "not both" in answer.json()["error"]["message"]


def test_priority_is_accepted_and_changes_no_answer(server):
    assert chat(server, max_tokens=6, extra_body={"priority": -3}) == chat(server, max_tokens=6)


def test_a_burst_past_max_waiting_gets_503s_and_the_accepted_complete(server):
    def ask(i: int) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 100, "ignore_eos": True}
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, range(12)))
    statuses = [a.status_code for a in answers]
    busy = [a for a in answers if a.status_code == 503]
    assert set(statuses) <= {200, 503} and busy and 200 in statuses, statuses
    assert all(a.headers["retry-after"] == "1" and a.json()["error"]["code"] == "overloaded" for a in busy)
    assert all(a.json()["usage"]["completion_tokens"] == 100 for a in answers if a.status_code == 200)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_cors_answers_the_configured_origin_only(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    good = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": ALLOWED, **preflight})
    assert good.status_code == 200 and good.headers["access-control-allow-origin"] == ALLOWED
    evil = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in evil.headers
    answer = httpx.get(server.url + "/v1/models", headers={"Origin": ALLOWED})
    assert answer.headers["access-control-allow-origin"] == ALLOWED
    assert (
        "access-control-allow-origin"
        not in httpx.get(server.url + "/v1/models", headers={"Origin": "http://x"}).headers
    )
