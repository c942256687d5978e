"""``POST /v1/rerank`` (and its ``/rerank``, ``/v2/rerank`` aliases) and ``POST /score`` over plain
HTTP against a real server on the tiny Qwen3: every score equals P(yes) / (P(yes) + P(no)) of a
plain transformers forward (the oracle) on Qwen3-Reranker's judging prompt, written out here as
its model card gives it; the ranking, ``top_n``, ``return_documents``, vLLM's pairings, concurrent
clients, the query's KV blocks computed once per request, and the 400s."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from conftest import logprob_oracle
from pipeline.serve.protocol import APIError
from pipeline.serve.rerank import (
    judge_tokens,
    prompt_text,
    score_pairs,
)

# Qwen3-Reranker's model card, verbatim (prefix + format_instruction + suffix).
CARD = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
WEB = "Given a web search query, retrieve relevant passages that answer the query"
QUERY = "What is the capital of China, and what is the city known for?"
DOCS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other.",
    "Beijing has palaces, temples and the Great Wall nearby.",
    "The cat is sleeping on the table.",
]
BLOCK = 16  # kv.block_size


@pytest.fixture(scope="module")
def server(qwen3_server):  # shared with other files on this worker (conftest.py)
    qwen3_server.http = httpx.Client(base_url=qwen3_server.url, timeout=120)
    return qwen3_server


def card_ids(lm, query: str, doc: str, instruction: str = WEB) -> list[int]:
    return lm.tokenizer(CARD.format(instruction=instruction, query=query, doc=doc), add_special_tokens=False)[
        "input_ids"
    ]


def oracle(lm, query: str, doc: str, instruction: str = WEB) -> float:
    """P(yes) / (P(yes) + P(no)) at the prompt's last position; the tiny tokenizer has neither
    word as one token, so each is scored by its first ("y", "n")."""
    yes = lm.tokenizer.encode("yes", add_special_tokens=False)[0]
    no = lm.tokenizer.encode("no", add_special_tokens=False)[0]
    row = logprob_oracle(lm, card_ids(lm, query, doc, instruction))[-1]
    return float(row[[no, yes]].softmax(-1)[1])


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def rerank(server, path: str = "/v1/rerank", **body) -> httpx.Response:
    return server.http.post(path, json={"model": "qwen3", **body})


def test_rerank_ranks_by_the_oracles_scores(server):
    documents = [DOCS[0], {"text": DOCS[1]}, DOCS[2], {"text": DOCS[3], "id": "ignored"}]
    out = rerank(server, query=QUERY, documents=documents)
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["id"].startswith("rerank-") and body["model"] == "qwen3"
    results = body["results"]
    expected = [oracle(server.lm, QUERY, d) for d in DOCS]
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    for r in results:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)
        assert r["document"] == {"text": DOCS[r["index"]]}
    prompt = sum(len(card_ids(server.lm, QUERY, d)) for d in DOCS)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] == prompt
    for alias in ("/rerank", "/v2/rerank"):
        again = rerank(server, alias, query=QUERY, documents=documents).json()["results"]
        assert [r["index"] for r in again] == [r["index"] for r in results]
        assert [r["relevance_score"] for r in again] == pytest.approx(scores, abs=1e-5)


def test_top_n_return_documents_and_instruction(server):
    full = rerank(server, query=QUERY, documents=DOCS).json()["results"]
    top = rerank(server, query=QUERY, documents=DOCS, top_n=2, return_documents=False).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in full[:2]]
    assert all(set(r) == {"index", "relevance_score"} for r in top)
    assert len(rerank(server, query=QUERY, documents=DOCS, top_n=10).json()["results"]) == 4
    task = "Given a question, find the passage that names a city"
    told = rerank(server, query=QUERY, documents=DOCS[:2], instruction=task).json()["results"]
    for r in told:
        assert r["relevance_score"] == pytest.approx(oracle(server.lm, QUERY, DOCS[r["index"]], task), abs=1e-4)


def test_score_pairs_as_vllm_and_equals_rerank(server):
    ranked = {r["index"]: r["relevance_score"] for r in rerank(server, query=QUERY, documents=DOCS).json()["results"]}
    out = server.http.post("/score", json={"model": "qwen3", "text_1": QUERY, "text_2": DOCS})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["id"].startswith("score-") and body["object"] == "list" and body["model"] == "qwen3"
    assert isinstance(body["created"], int) and body["usage"]["completion_tokens"] == 0
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and {d["object"] for d in body["data"]} == {"score"}
    assert [d["score"] for d in body["data"]] == pytest.approx([ranked[i] for i in range(4)], abs=1e-5)
    one = server.http.post("/v1/score", json={"text_1": [QUERY], "text_2": DOCS[2]}).json()["data"]
    assert [d["score"] for d in one] == pytest.approx([ranked[2]], abs=1e-5)
    other = "Where do cats sleep?"
    pairwise = server.http.post("/score", json={"text_1": [QUERY, other], "text_2": DOCS[:2]}).json()["data"]
    expected = [oracle(server.lm, QUERY, DOCS[0]), oracle(server.lm, other, DOCS[1])]
    assert [d["score"] for d in pairwise] == pytest.approx(expected, abs=1e-4)


def test_the_query_is_computed_once_per_request(server):
    query = (
        "Which passages describe how a small river flows through a green valley between tall mountains, "
        "and what the weather is like there in the morning?"
    )
    docs = ["The river flows through the valley.", "The sky is blue.", "Trains leave at nine.", "A dog runs."]
    prompts = [card_ids(server.lm, query, d) for d in docs]
    common = min(shared_prefix(p, prompts[0]) for p in prompts[1:])
    before_query = shared_prefix(prompts[0], card_ids(server.lm, "Other?", docs[0]))
    assert common - before_query > 2 * BLOCK  # the query fills whole blocks of its own
    body = rerank(server, query=query, documents=docs).json()
    shared = common // BLOCK * BLOCK
    # This query is new to the server: the first pair computes its blocks, the other three take them.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * shared


def test_concurrent_clients_get_their_solo_answers(server):
    asks = [
        {"query": f"Question {k}: what is in the picture number {k}?", "documents": [DOCS[k % 4], DOCS[(k + 1) % 4]]}
        for k in range(6)
    ]
    solo = [rerank(server, **ask).json()["results"] for ask in asks]
    together: list = [None] * len(asks)
    start = threading.Barrier(len(asks))

    def client(k: int) -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            start.wait()
            together[k] = http.post("/v1/rerank", json=asks[k]).json()["results"]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for alone, mixed in zip(solo, together):
        assert [r["index"] for r in mixed] == [r["index"] for r in alone]
        assert [r["relevance_score"] for r in mixed] == pytest.approx([r["relevance_score"] for r in alone], abs=1e-5)


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, 400, "documents: empty"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, 400, "top_n must be >= 1"),
        ("/v1/rerank", {"documents": DOCS}, 400, "query: Field required"),
        ("/v1/rerank", {"query": QUERY, "documents": [3]}, 400, "documents.0"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "truncate_prompt_tokens": 8, "rank_fields": []}, 400,
         "rank_fields, truncate_prompt_tokens: not supported"),
        ("/v1/rerank", {"model": "other", "query": QUERY, "documents": DOCS}, 404, "model 'other' not found"),
        ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCS[:3]}, 400, "text_1 has 2 texts and text_2 3"),
        ("/score", {"text_1": QUERY, "text_2": []}, 400, "text_2: empty"),
        ("/score", {"text_1": QUERY, "text_2": DOCS, "priority": 1}, 400, "priority: not supported"),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_by_name(server, path, body, status, message):
    out = server.http.post(path, json=body)
    assert out.status_code == status, out.text
    assert message in out.json()["error"]["message"]


# --- without a server ------------------------------------------------------------------------------


class WordTokenizer:
    """A tokenizer of whole words from a table (unknown words: one token per character)."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab, self.words = vocab, {v: k for k, v in vocab.items()}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab[text]] if text in self.vocab else [self.vocab.get(c, 0) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.words.get(i, "?") for i in ids)


def test_judge_tokens(tiny_dir):
    assert judge_tokens(WordTokenizer({"yes": 5, "no": 7})) == (5, 7)
    assert judge_tokens(WordTokenizer({" yes": 5, " no": 7})) == (5, 7)
    tiny = AutoTokenizer.from_pretrained(tiny_dir("qwen3"))
    y, n = judge_tokens(tiny)
    assert (tiny.decode([y]), tiny.decode([n])) == ("y", "n")  # no single-token word: its first token
    with pytest.raises(APIError, match="no token for 'no'"):  # its first token is not an "n"
        judge_tokens(WordTokenizer({"yes": 5}))
    with pytest.raises(APIError, match="no token for 'yes'"):
        judge_tokens(WordTokenizer({"no": 7}))


def test_the_prompt_is_the_model_cards(tiny_dir):
    tiny = AutoTokenizer.from_pretrained(tiny_dir("qwen3"))
    assert prompt_text(tiny, None, "q?", "d.") == CARD.format(instruction=WEB, query="q?", doc="d.")
    bare = SimpleNamespace(chat_template=None)  # no template: the model card's text as is
    assert prompt_text(bare, "task", "q?", "d.") == CARD.format(instruction="task", query="q?", doc="d.")


def test_pairings():
    assert score_pairs("q", "d") == [("q", "d")]
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    with pytest.raises(APIError, match="text_1: empty"):
        score_pairs([], ["a"])


def test_a_classification_head_scores_as_the_checkpoints_own_forward(tmp_path):
    """A ``*ForSequenceClassification`` checkpoint saved by transformers (not by the project's
    builders) loads as a causal LM; ``ScoreHead`` reads its head from the files, and the score of
    the prompt's last hidden state (the engine's ``pooling="last"``) equals the checkpoint's own
    classifier forward."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from pipeline import Pipeline, load_model
    from pipeline.context import Request
    from pipeline.serve.rerank import ScoreHead
    from pipeline.testing import make_tokenizer
    from stages import Prefill

    tok = make_tokenizer("qwen3")
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_labels=1, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    classifier = Qwen3ForSequenceClassification(cfg).eval()
    classifier.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype=torch.float32)
    head = ScoreHead.of(lm)
    ids = tok(prompt_text(tok, None, QUERY, DOCS[0]), add_special_tokens=False)["input_ids"]
    pooled = Pipeline(lm, {"prefill": Prefill()}).run_ids(ids, Request(pooling="last")).pooled
    with torch.no_grad():
        expected = classifier(torch.tensor([ids])).logits[0, 0].sigmoid()
    assert float(head(pooled[None])[0]) == pytest.approx(float(expected), abs=1e-5)
