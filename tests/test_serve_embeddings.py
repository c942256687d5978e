"""``POST /v1/embeddings`` through the ``openai`` client against a real server on the tiny Qwen3:
each embedding equals the last-token hidden state of a plain transformers forward, normalised;
deterministic; text or token ids; ``dimensions`` and both encodings; concurrent clients each get
their solo answer; bad input is a 400 naming the field; ``/v1/models`` tells the dimensions."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from openai import BadRequestError, OpenAI
from transformers import AutoModel


TEXTS = ["The capital of China is Beijing.", "Gravity attracts two bodies.", "the cat sleeps " * 12]


@pytest.fixture(scope="module")
def server(qwen3_server, tiny_dir):  # shared with other files on this worker (conftest.py)
    qwen3_server.client = OpenAI(base_url=qwen3_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    qwen3_server.base = AutoModel.from_pretrained(str(tiny_dir("qwen3")), dtype=torch.float32).eval()
    return qwen3_server


def oracle(server, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        last = server.base(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(last, dim=0).numpy()


def ids_of(server, text: str) -> list[int]:
    return server.lm.tokenizer(text)["input_ids"]


def embed(server, inputs, **kw) -> list[np.ndarray]:
    answer = server.client.embeddings.create(model="qwen3", input=inputs, **kw)
    assert [d.index for d in answer.data] == list(range(len(answer.data)))
    return [np.asarray(d.embedding, dtype=np.float32) for d in answer.data]


def test_each_embedding_is_the_last_hidden_state_of_a_plain_forward(server):
    answer = server.client.embeddings.create(model="qwen3", input=TEXTS)
    assert answer.usage.prompt_tokens == sum(len(ids_of(server, t)) for t in TEXTS)
    for text, item in zip(TEXTS, answer.data):
        got = np.asarray(item.embedding, dtype=np.float32)
        assert abs(np.linalg.norm(got) - 1) < 1e-5
        assert 1 - float(got @ oracle(server, ids_of(server, text))) < 1e-3
    again = embed(server, TEXTS)  # deterministic (the last prompt's prefix now cached, too)
    assert all(np.allclose(a, np.asarray(b.embedding), atol=1e-6) for a, b in zip(again, answer.data))


def test_token_ids_dimensions_and_both_encodings(server):
    ids = [ids_of(server, t) for t in TEXTS[:2]]
    whole = embed(server, TEXTS[:2])
    assert all(np.allclose(a, b, atol=1e-6) for a, b in zip(embed(server, ids), whole))
    assert np.allclose(embed(server, ids[0])[0], whole[0], atol=1e-6)
    cut = embed(server, TEXTS[0], dimensions=16)[0]
    assert cut.shape == (16,) and np.allclose(cut, whole[0][:16] / np.linalg.norm(whole[0][:16]), atol=1e-6)
    body = {"model": "qwen3", "input": TEXTS[0]}
    floats = httpx.post(server.url + "/v1/embeddings", json={**body, "encoding_format": "float"}).json()
    raw = httpx.post(server.url + "/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, floats["data"][0]["embedding"], atol=0) and np.allclose(decoded, whole[0], atol=1e-6)


def test_concurrent_clients_each_get_their_solo_answer(server):
    texts = [f"document number {i} is about {'sea ' * i}" for i in range(8)]
    solo = [embed(server, t)[0] for t in texts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda t: embed(server, t)[0], texts))
    assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(solo, together))


def test_models_lists_the_embedding_dimensions(server):
    model = httpx.get(server.url + "/v1/models").json()["data"][0]
    hidden = server.lm.model.config.hidden_size
    assert model["embedding"] == {"dimensions": hidden, "pooling": "last", "normalized": True}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": []}, "input is empty"),
        ({"input": ["fine", ""]}, "input[1] is empty"),
        ({"input": [[1, 2, 10**9]]}, "outside the vocabulary"),
        ({"input": "x", "dimensions": 10**6}, "dimensions must be at most"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens: not supported"),
    ],
)
def test_bad_input_is_a_400_naming_it(server, body, message):
    answer = httpx.post(server.url + "/v1/embeddings", json={"model": "qwen3", **body}, timeout=60)
    assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text


def test_the_openai_client_raises_on_a_bad_request(server):
    with pytest.raises(BadRequestError, match="input is empty"):
        server.client.embeddings.create(model="qwen3", input=[])
