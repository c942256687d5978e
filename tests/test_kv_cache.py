"""KVCache on the paged pool: any sequence of reuse / rollback / restore / fork gives exactly the
tokens of a fresh run, and the blocks are accounted for (shared, copied on write, returned).
Every case runs on a full-precision pool and on an int8 one (``kv.dtype``): a quantised pool
gives the tokens of a fresh run with the same ``kv.dtype``."""

from __future__ import annotations

import gc

import pytest
import torch

from pipeline import KVCache, Pipeline, Request
from stages import DecodeLoop, Prefill

N = 8


POOL = 3 << 20  # this module's own pool (pipelines with the same settings share one)
KV = {"dtype": "auto"}  # the kv.dtype of the pass running now (the kv_dtype fixture sets it)


@pytest.fixture(scope="module", params=["auto", "int8"], autouse=True)
def kv_dtype(request):
    KV["dtype"] = request.param
    yield request.param
    KV["dtype"] = "auto"


def make_pipe(lm) -> Pipeline:
    return Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=POOL, kv_dtype=KV["dtype"])


def run_ids(lm, ids: list[int], cache: KVCache | None = None, n: int = N):
    """Prefill + decode from raw ids (no template), on the given cache."""
    pipe = make_pipe(lm)
    ctx = pipe.run_ids(ids, Request(max_new_tokens=n, ignore_eos=True), cache)
    return ctx.generated, ctx.metrics.to_dict(), ctx.cache


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("qwen3")


@pytest.fixture(scope="module")
def prompt(lm):
    return lm.tokenizer("The quick brown fox jumps over the lazy dog, again and again.")["input_ids"]


@pytest.fixture(autouse=True)
def no_prefix_cache(lm):
    """Each test starts with nothing cached from the others."""
    gc.collect()  # caches of earlier tests give their blocks back
    make_pipe(lm).pool.clear_prefix_cache()


def blocks_for(cache: KVCache) -> int:
    return -(-cache.length // cache.block_size)


def test_cache_holds_prompt_and_fed_tokens(lm, prompt):
    out, metrics, cache = run_ids(lm, prompt)
    assert len(out) == N
    assert cache.length == len(prompt) + N - 1  # the last sampled token is not fed yet
    assert cache.keys == prompt + out[:-1]
    assert len(cache.blocks) == blocks_for(cache)
    assert metrics["prefill_tokens"] == len(prompt) and metrics["kv_reused_tokens"] == 0


def test_nbytes_matches_shape_arithmetic(lm, prompt, kv_dtype):
    _, _, cache = run_ids(lm, prompt)
    cfg = lm.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = torch.finfo(lm.model.dtype).bits // 8
    per_head = head_dim * elem if kv_dtype == "auto" else head_dim + 2  # one byte an element + a float16 scale
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * per_head
    assert cache.nbytes == per_token * cache.block_size * blocks_for(cache)  # whole blocks are held


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
    assert cache.length == len(prompt) - 5 and len(cache.blocks) == blocks_for(cache)
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
    cache = make_pipe(lm).new_cache()
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
    cache = make_pipe(lm).new_cache()
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


def test_dropped_blocks_go_back_to_the_pool(lm, prompt):
    pool = make_pipe(lm).pool
    used = pool.used_blocks
    _, _, cache = run_ids(lm, prompt * 3, n=20)
    assert pool.used_blocks == used + len(cache.blocks)
    cache.rollback(cache.block_size)
    assert pool.used_blocks == used + 1
    cache.clear()
    assert pool.used_blocks == used


def test_fork_shares_blocks_and_copies_the_partial_one_on_write(lm, prompt):
    ids = prompt * 2
    pool = make_pipe(lm).pool
    _, _, cache = run_ids(lm, ids, n=1)
    assert cache.length % cache.block_size, "the test needs a partial last block"
    other = cache.fork()
    assert other.blocks == cache.blocks and all(pool.refs[b] == 2 for b in cache.blocks)
    used = pool.used_blocks
    tails = [lm.tokenizer(" red roses")["input_ids"], lm.tokenizer(" blue sky")["input_ids"]]
    got_a, _, _ = run_ids(lm, ids + tails[0], cache)
    got_b, _, _ = run_ids(lm, ids + tails[1], other)
    full = cache.length // cache.block_size
    shared_full = (len(ids)) // cache.block_size
    assert cache.blocks[:shared_full] == other.blocks[:shared_full]  # the full prefix blocks stay shared
    assert cache.blocks[shared_full] != other.blocks[shared_full]  # the partial one was copied
    assert pool.used_blocks > used and full >= shared_full
    assert got_a == run_ids(lm, ids + tails[0])[0]
    assert got_b == run_ids(lm, ids + tails[1])[0]


def test_prefix_cache_outlives_the_request_until_the_pool_needs_its_blocks(lm):
    pipe = make_pipe(lm)
    pool = pipe.pool
    long = lm.tokenizer("Green valleys and quiet rivers, far from the towns of other tests.")["input_ids"] * 4
    _, _, cache = run_ids(lm, long, n=2)
    cached_blocks = len(long) // cache.block_size
    cache.clear()  # the request is over: its full blocks stay, unreferenced, in the prefix cache
    out, metrics, again = run_ids(lm, long, n=2)
    assert metrics["kv_reused_tokens"] == cached_blocks * cache.block_size
    again.clear()
    # Fill the pool with other work: the cached blocks are handed out (oldest first), never lost work.
    free = pool.free_blocks
    hogs = [pipe.new_cache() for _ in range(free)]
    for h in hogs:
        h.reserve(1)
        h.append([0])
    assert pool.free_blocks == 0
    for h in hogs:
        h.clear()
    _, metrics, _ = run_ids(lm, long, n=2)
    assert metrics["kv_reused_tokens"] == 0  # evicted


def test_uninitialised_pool_memory_never_reaches_the_answer(lm, prompt, monkeypatch):
    """Masked-out slots still enter the attention product, and NaN * 0 is NaN: blocks must be
    zeroed before first use. Here the pool's memory starts out as NaN."""
    import pipeline.kv.pool as pool_module

    class NaNTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            return torch.empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(pool_module, "torch", NaNTorch())
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=1 << 20)
    got = pipe.run_ids(prompt, Request(max_new_tokens=N, ignore_eos=True)).generated
    monkeypatch.undo()
    want = lm.model.generate(
        input_ids=torch.tensor([prompt], device=lm.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=lm.device),
        do_sample=False,
        max_new_tokens=N,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :]
    assert got == want.tolist()
