"""KVCache: any sequence of reuse / rollback / restore gives exactly the tokens of a fresh run."""
from __future__ import annotations

import pytest
import torch

from pipeline import KVCache, Pipeline, Request
from stages import DecodeLoop, Prefill

N = 8


def run_ids(lm, ids: list[int], cache: KVCache | None = None, n: int = N):
    """Prefill + decode from raw ids (no template), on the given cache."""
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()})
    ctx = pipe.run_ids(ids, Request(max_new_tokens=n, ignore_eos=True), cache)
    return ctx.generated, ctx.metrics.to_dict(), ctx.cache


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("qwen3")


@pytest.fixture(scope="module")
def prompt(lm):
    return lm.tokenizer("The quick brown fox jumps over the lazy dog, again and again.")["input_ids"]


def test_cache_holds_prompt_and_fed_tokens(lm, prompt):
    out, metrics, cache = run_ids(lm, prompt)
    assert len(out) == N
    assert cache.length == len(prompt) + N - 1  # the last sampled token is not fed yet
    assert cache.keys == prompt + out[:-1]
    assert cache.cache.get_seq_length() == cache.length
    assert metrics["prefill_tokens"] == len(prompt) and metrics["kv_reused_tokens"] == 0


def test_nbytes_matches_shape_arithmetic(lm, prompt):
    _, _, cache = run_ids(lm, prompt)
    cfg = lm.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = torch.finfo(lm.model.dtype).bits // 8
    expected = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * cache.length * elem
    assert cache.nbytes == expected


def test_reuse_of_identical_prompt_leaves_one_token(lm, prompt):
    fresh, _, cache = run_ids(lm, prompt)
    again, metrics, _ = run_ids(lm, prompt, cache)
    assert again == fresh
    assert metrics["kv_reused_tokens"] == len(prompt) - 1
    assert metrics["prefill_tokens"] == 1


def test_rollback_into_prompt_equals_fresh(lm, prompt):
    other = prompt[:-5] + lm.tokenizer(" cats sleep all day")["input_ids"]
    _, _, cache = run_ids(lm, prompt)
    cache.rollback(len(prompt) - 5)
    assert cache.length == len(prompt) - 5 == cache.cache.get_seq_length()
    got, metrics, _ = run_ids(lm, other, cache)
    fresh, _, _ = run_ids(lm, other)
    assert got == fresh
    assert metrics["kv_reused_tokens"] == len(prompt) - 5
    assert metrics["prefill_tokens"] == len(other) - (len(prompt) - 5)


def test_reuse_into_generated_tokens_equals_fresh(lm, prompt):
    first, _, cache = run_ids(lm, prompt)
    follow = prompt + first[:4] + lm.tokenizer(" and then")["input_ids"]
    got, metrics, _ = run_ids(lm, follow, cache)
    fresh, _, _ = run_ids(lm, follow)
    assert got == fresh
    assert metrics["kv_reused_tokens"] == len(prompt) + 4
    assert metrics["prefill_tokens"] == len(follow) - len(prompt) - 4


def test_snapshot_restore_branches_equal_fresh_runs(lm, prompt):
    cache = KVCache(lm.config)
    run_ids(lm, prompt, cache, n=1)  # prefill the shared prefix (the one sampled token is not fed)
    snap = cache.snapshot()
    tails = [" red", " green apples", " blue sky today"]
    for tail in tails:
        ids = prompt + lm.tokenizer(tail)["input_ids"]
        cache.restore(snap)
        got, metrics, _ = run_ids(lm, ids, cache)
        assert metrics["kv_reused_tokens"] == len(prompt)
        fresh, _, _ = run_ids(lm, ids)
        assert got == fresh


def test_restore_after_clear_is_refused(lm, prompt):
    cache = KVCache(lm.config)
    run_ids(lm, prompt, cache, n=1)
    snap = cache.snapshot()
    cache.clear()
    assert cache.length == 0 and cache.nbytes == 0
    with pytest.raises(ValueError, match="snapshot"):
        cache.restore(snap)


def test_rollback_bounds(lm, prompt):
    _, _, cache = run_ids(lm, prompt, n=1)
    with pytest.raises(ValueError):
        cache.rollback(cache.length + 1)
    with pytest.raises(ValueError):
        cache.rollback(-1)
    cache.rollback(0)
    assert cache.length == 0
