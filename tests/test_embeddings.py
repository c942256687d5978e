"""Embeddings (``Request.pooling``, issue 50): any decoder embeds a prompt through the engine's
prefill-only path, equal to a plain transformers forward's final hidden states pooled and
L2-normalised, batched with other requests (which keep their solo answers), in chunks, with a
cached prefix where the pooling allows it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from pipeline import Pipeline, Request, UserError
from stages import DecodeLoop, Prefill, Tokenize

TEXTS = ["the quick brown fox jumps over the lazy dog " * 4, "hello there", "a b c d e f g h i j k l m n o p q"]


def engine(lm, chunk_size: int | None = None) -> Pipeline:
    stages = {"tokenize": Tokenize(), "prefill": Prefill(chunk_size=chunk_size), "decode": DecodeLoop()}
    return Pipeline(lm, stages, kv_memory=16 << 20, max_seqs=8)


def oracle(path, ids: list[int], pooling: str) -> torch.Tensor:
    """The plain forward's last hidden states, pooled and normalised."""
    base = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = base(input_ids=torch.tensor([ids])).last_hidden_state[0]
    pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(pooled, dim=0)


def ids_of(lm, text: str) -> list[int]:
    return lm.tokenizer(text)["input_ids"]


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])  # gemma3: soft-capped logits, the model's own head
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_equal_a_plain_forward_batched_with_generation(load_tiny, tiny_dir, family, pooling):
    lm = load_tiny(family)
    pipe = engine(lm, chunk_size=7)  # the long prompt prefills in several chunks
    solo = pipe.run(Request(prompt="Tell me a story.", max_new_tokens=6, ignore_eos=True))
    generating = pipe.submit(Request(prompt="Tell me a story.", max_new_tokens=6, ignore_eos=True))
    handles = [pipe.submit(Request(pooling=pooling), ids=ids_of(lm, t)) for t in TEXTS]
    results = [h.result() for h in handles]
    assert generating.result().token_ids == solo.token_ids
    for text, result in zip(TEXTS, results):
        got = torch.tensor(result.embedding)
        assert got.norm().item() == pytest.approx(1.0, abs=1e-5)
        assert 1 - float(got @ oracle(tiny_dir(family), ids_of(lm, text), pooling)) < 1e-4
        assert result.token_ids == [] and result.prompt_ids == ids_of(lm, text)


def test_last_token_pooling_reuses_a_cached_prefix_and_mean_recomputes(load_tiny):
    lm = load_tiny("qwen3")
    pipe = engine(lm)
    ids = ids_of(lm, TEXTS[0])
    first = pipe.wait(pipe.submit(Request(pooling="last"), ids=ids))
    again = pipe.wait(pipe.submit(Request(pooling="last"), ids=ids))
    assert again.metrics["kv_reused_tokens"] > 0 and again.embedding == pytest.approx(first.embedding, abs=1e-6)
    mean = [pipe.wait(pipe.submit(Request(pooling="mean"), ids=ids)) for _ in range(2)]
    assert mean[1].metrics["kv_reused_tokens"] == 0 and mean[1].embedding == pytest.approx(mean[0].embedding, abs=1e-6)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (Request(pooling="max"), "pooling must be one of last, mean, cls"),
        (Request(pooling="last", logprobs=2), "no log-probabilities"),
    ],
)
def test_a_bad_embedding_request_fails_alone(load_tiny, request_, message):
    lm = load_tiny("qwen3")
    pipe = engine(lm)
    good = pipe.submit(Request(pooling="last"), ids=ids_of(lm, "fine"))
    bad = pipe.submit(request_, ids=ids_of(lm, "bad"))
    with pytest.raises(UserError, match=message):
        bad.result()
    assert len(good.result().embedding) == lm.model.config.get_text_config().hidden_size
