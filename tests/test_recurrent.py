"""Qwen3.5's linear-attention layers in the paged engine: recurrent states and their checkpoints.

The oracle is recomputation: whatever a cache went through (reuse, rollback, snapshot, restore,
fork, other requests' prefix-cache entries), the next answer equals ``generate()`` on the full
ids, and what was recomputed is counted in ``prefill_tokens``.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from pipeline import KVCache, Pipeline, Request
from pipeline.errors import UserError
from stages import DecodeLoop, Prefill, Speculative, Tokenize

N = 6
BLOCK = 4
EVERY = 8  # checkpoint every 8 tokens: a few per prompt


def make_pipe(lm, every: int = EVERY, memory: int = 4 << 20, chunk: int | None = None) -> Pipeline:
    return Pipeline(
        lm,
        {"prefill": Prefill(chunk_size=chunk), "decode": DecodeLoop()},
        kv_memory=memory,
        kv_block_size=BLOCK,
        kv_state_checkpoint_every=every,
    )


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("qwen3.5-text")


@pytest.fixture(autouse=True)
def no_prefix_cache(lm):
    gc.collect()
    make_pipe(lm).pool.clear_prefix_cache()


def oracle(lm, ids: list[int], n: int = N) -> list[int]:
    with torch.no_grad():
        out = lm.model.generate(
            torch.tensor([ids], device=lm.device), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(ids) :].tolist()


def run_ids(pipe: Pipeline, ids: list[int], cache: KVCache | None = None, n: int = N):
    ctx = pipe.run_ids(ids, Request(max_new_tokens=n, ignore_eos=True), cache)
    return ctx.generated, ctx.metrics.to_dict()


def words(rng: random.Random, lm, n: int) -> list[int]:
    vocab = lm.config.get_text_config().vocab_size
    return [rng.randrange(10, min(vocab, 1000)) for _ in range(n)]


def test_layers_of_both_kinds_and_generate_equality(lm):
    kinds = set(lm.config.get_text_config().layer_types)
    assert kinds == {"linear_attention", "full_attention"} and lm.recurrent
    ids = words(random.Random(0), lm, 37)
    for chunk in (None, 5):  # one prefill, or chunks crossing checkpoints and blocks
        pipe = make_pipe(lm, chunk=chunk)
        pipe.pool.clear_prefix_cache()
        out, metrics = run_ids(pipe, ids)
        assert out == oracle(lm, ids)
        assert metrics["prefill_tokens"] == 37


def test_random_cache_operations_equal_recomputing(lm):
    """A random mix of grow / branch / rollback / snapshot / restore / fork / drop on several
    caches over one pool (fixed seeds): every answer equals ``generate()`` on its full ids, every
    prompt token is either reused or recomputed, and the pool gets every block and slot back."""
    pipe = make_pipe(lm)
    for seed in range(3):
        rng = random.Random(seed)
        caches: list[KVCache] = [pipe.new_cache()]
        owner = None
        snaps: list[tuple[KVCache, object]] = []
        for _ in range(14):
            op = rng.choice(["grow", "grow", "branch", "rollback", "snapshot", "restore", "fork", "drop"])
            cache = rng.choice(caches)
            if op in ("grow", "branch"):
                keep = cache.length if op == "grow" else rng.randrange(0, cache.length + 1)
                ids = list(cache.keys[:keep]) + words(rng, lm, rng.randrange(1, 14))
                out, metrics = run_ids(pipe, ids, cache)
                assert out == oracle(lm, ids), (seed, op)
                assert metrics["kv_reused_tokens"] + metrics["prefill_tokens"] == len(ids)
                assert cache.keys == ids + out[:-1]
            elif op == "rollback" and cache.length:
                before, n = list(cache.keys), rng.randrange(0, cache.length + 1)
                reached = cache.rollback(n)
                assert reached <= n and cache.keys == before[:reached] and cache.length == reached
                assert all(p <= reached for p in cache.checkpoints)
            elif op == "snapshot":
                snaps.append((cache, cache.snapshot()))
            elif op == "restore" and snaps:
                owner, snap = rng.choice(snaps)
                if (
                    any(c is owner for c in caches)
                    and tuple(owner.keys[: snap.length]) == snap.keys
                    and owner.length >= snap.length
                ):
                    owner.restore(snap)
                    assert owner.length <= snap.length
                owner = None
            elif op == "fork":
                caches.append(cache.fork())
            elif op == "drop" and len(caches) > 1:
                caches = [c for c in caches if c is not cache]
                snaps = [(c, s) for c, s in snaps if c is not cache]
        for cache in caches:  # every survivor still answers exactly
            ids = list(cache.keys) + words(rng, lm, 3)
            assert run_ids(pipe, ids, cache)[0] == oracle(lm, ids)
        del cache, caches, snaps
        gc.collect()
        pipe.pool.clear_prefix_cache()
        assert pipe.pool.used_blocks == 0
        states = pipe.pool.states
        assert states.free_slots == states.num_slots - 1  # all but the zero state


def test_rollback_goes_to_the_nearest_checkpoint_and_the_rest_is_recomputed(lm):
    pipe = make_pipe(lm)
    ids = words(random.Random(1), lm, 30)
    cache = pipe.new_cache()
    out, _ = run_ids(pipe, ids, cache)
    # checkpoints: every 8 tokens, the prompt's end (30) and its last block boundary (28)
    assert {8, 16, 24, 28, 30} <= set(cache.checkpoints)
    assert cache.rollback(27) == 24  # no state at 27: back to 24
    branch = ids[:27] + words(random.Random(2), lm, 5)
    again, metrics = run_ids(pipe, branch, cache)
    assert again == oracle(lm, branch)
    assert metrics["kv_reused_tokens"] == 24 and metrics["prefill_tokens"] == len(branch) - 24


def test_a_rollback_no_checkpoint_serves_recomputes_from_the_start(lm):
    pipe = make_pipe(lm, every=1024)
    ids = words(random.Random(3), lm, 13)
    cache = pipe.new_cache()
    run_ids(pipe, ids, cache)
    assert cache.rollback(7) == 0 and cache.length == 0  # checkpoints only at 12 and 13
    _, metrics = run_ids(pipe, ids[:7] + [42, 43], cache)
    assert metrics["prefill_tokens"] == 9


def test_snapshot_branches_equal_fresh_runs(lm):
    pipe = make_pipe(lm, every=1024)
    rng = random.Random(4)
    shared = words(rng, lm, 11)  # not a block boundary, no periodic checkpoint: checkpoint_at does it
    cache = pipe.new_cache()
    cache.checkpoint_at(len(shared))
    first, _ = run_ids(pipe, shared + words(rng, lm, 4), cache)
    assert cache.rollback(len(shared)) == len(shared)
    snap = cache.snapshot()
    for _ in range(3):
        ids = shared + words(rng, lm, rng.randrange(1, 6))
        cache.restore(snap)
        out, metrics = run_ids(pipe, ids, cache)
        assert out == oracle(lm, ids) and metrics["kv_reused_tokens"] == len(shared)


def test_run_shared_prefix_computes_the_prefix_once(lm):
    from pipeline.frontends.prefix import run_shared_prefix

    pipe = Pipeline(
        lm,
        {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()},
        kv_memory=4 << 20,
        kv_block_size=BLOCK,
        kv_state_checkpoint_every=1024,
    )
    system = "You answer in one word. " * 3
    requests = [
        Request(prompt=q, system_prompt=system, max_new_tokens=N, ignore_eos=True) for q in ("Red?", "Blue sky?", "Go")
    ]
    results = run_shared_prefix(pipe, requests)
    reused = [r.metrics["kv_reused_tokens"] for r in results]
    assert reused[0] == 0 and reused[1] > 10 and reused[1] == reused[2]
    for result in results:
        assert result.token_ids == oracle(lm, result.prompt_ids)


def test_prefix_cache_across_requests_stops_at_a_registered_state(lm):
    pipe = make_pipe(lm)
    rng = random.Random(5)
    ids = words(rng, lm, 21)
    run_ids(pipe, ids)  # its cache is released; block-boundary states stay registered
    other = ids[:19] + words(rng, lm, 3)
    cache = pipe.new_cache()
    out, metrics = run_ids(pipe, other, cache)
    assert out == oracle(lm, other)
    assert metrics["kv_reused_tokens"] == 16  # blocks up to 16 have a state (every 8); 20 is past the common 19
    assert {8, 16} <= set(cache.checkpoints)  # the registered states it passed are its own checkpoints too
    assert cache.rollback(12) == 8


def test_fork_shares_states_and_each_branch_is_exact(lm):
    pipe = make_pipe(lm)
    rng = random.Random(6)
    ids = words(rng, lm, 18)
    cache = pipe.new_cache()
    run_ids(pipe, ids, cache)
    twin = cache.fork()
    assert twin.slot == cache.slot and twin.checkpoints == cache.checkpoints  # shared, not copied
    a, b = list(cache.keys) + words(rng, lm, 3), list(twin.keys) + words(rng, lm, 5)
    assert run_ids(pipe, a, cache)[0] == oracle(lm, a)
    assert run_ids(pipe, b, twin)[0] == oracle(lm, b)


def test_batched_sequences_equal_solo(lm):
    pipe = make_pipe(lm, chunk=6)
    rng = random.Random(7)
    prompts = [words(rng, lm, n) for n in (5, 17, 29, 9, 40)]
    before = pipe.engine.counters["steps"]
    handles = [pipe.submit(Request(max_new_tokens=N + i, ignore_eos=True), ids=p) for i, p in enumerate(prompts)]
    for i, (p, h) in enumerate(zip(prompts, handles)):
        assert h.result().token_ids == oracle(lm, p, N + i)
    solo = sum(-(-len(p) // 6) + N + i - 1 for i, p in enumerate(prompts))
    assert pipe.engine.counters["steps"] - before < solo / 2  # they shared steps


def test_kv_cache_bytes_count_the_states(lm):
    pipe = make_pipe(lm)
    ids = words(random.Random(8), lm, 20)
    cache = pipe.new_cache()
    _, metrics = run_ids(pipe, ids, cache)
    slots = {cache.slot, *cache.checkpoints.values()}
    blocks = -(-cache.length // BLOCK) * pipe.pool.block_bytes
    assert metrics["kv_cache_bytes"] == cache.nbytes == blocks + len(slots) * pipe.pool.states.slot_bytes
    text = lm.config.get_text_config()
    linear = text.layer_types.count("linear_attention")
    conv = (
        2 * text.linear_num_key_heads * text.linear_key_head_dim
        + text.linear_num_value_heads * text.linear_value_head_dim
    ) * (text.linear_conv_kernel_dim - 1)
    matrix = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim
    assert pipe.pool.states.slot_bytes == linear * (conv * lm.model.dtype.itemsize + matrix * 4)
    full = text.layer_types.count("full_attention")
    assert (
        pipe.pool.block_bytes == 2 * full * text.num_key_value_heads * text.head_dim * BLOCK * lm.model.dtype.itemsize
    )


def test_pool_size_counts_the_states(lm):
    from pipeline.kv import pool_for

    small = make_pipe(lm).pool.states.slot_bytes
    pool = pool_for(lm, 64 * small, BLOCK, checkpoint_every=EVERY, max_seqs=2)
    used = (pool.num_blocks - 1) * pool.block_bytes + (pool.states.num_slots - 1) * small
    assert used <= 64 * small and pool.states.num_slots - 1 >= 2 * 2 + 2 * 2
    with pytest.raises(UserError, match="recurrent-state slots"):
        pool_for(lm, 8 * small, BLOCK, checkpoint_every=EVERY, max_seqs=2)
    with pytest.raises(UserError, match="multiple of kv.block_size"):
        pool_for(lm, 64 * small, BLOCK, checkpoint_every=6)


def test_out_of_slots_preempts_and_answers_stay_exact(lm):
    """A pool with state slots for few sequences: the engine preempts, then recomputes."""
    pipe = make_pipe(lm)
    slots = pipe.pool.states.slot_bytes
    tight = Pipeline(
        lm,
        {"prefill": Prefill(), "decode": DecodeLoop()},
        kv_memory=24 * slots + (64 << 10),
        kv_block_size=BLOCK,
        kv_state_checkpoint_every=EVERY,
        max_seqs=4,
    )
    rng = random.Random(9)
    prompts = [words(rng, lm, 12) for _ in range(6)]
    handles = [tight.submit(Request(max_new_tokens=N, ignore_eos=True), ids=p) for p in prompts]
    for p, h in zip(prompts, handles):
        assert h.result().token_ids == oracle(lm, p)
    assert tight.engine.counters["preemptions"] > 0


def test_speculative_decoding_verifies_from_a_state_per_draft(lm):
    """Drafts known to be 3 of 4 right (every round partly rejected), and n-gram drafts: the
    tokens of ``generate()``, and each rejection rolls back to the state after the last accepted
    draft, so nothing is recomputed (``prefill_tokens`` covers the prompt alone) and the cache goes
    on exactly from there."""
    from test_speculative import Knowing

    rng = random.Random(10)
    ids = words(rng, lm, 13)
    want = oracle(lm, ids, 48)  # long enough for a random model's answer to come back to its own tokens
    for method in (Knowing(want, len(ids)), Speculative("ngram", num_draft=4)):
        spec = Pipeline(
            lm,
            {"prefill": Prefill(), "decode": DecodeLoop(speculative=method)},
            kv_memory=4 << 20,
            kv_block_size=BLOCK,
            kv_state_checkpoint_every=EVERY,
        )
        cache = spec.new_cache()
        ctx = spec.run_ids(ids, Request(max_new_tokens=48, ignore_eos=True), cache)
        m = ctx.metrics.to_dict()
        assert ctx.generated == want and m["prefill_tokens"] + m["kv_reused_tokens"] == len(ids)
        assert cache.keys == ids + want[:-1]
        more = list(cache.keys) + words(rng, lm, 3)
        assert spec.run_ids(more, Request(max_new_tokens=8, ignore_eos=True), cache).generated == oracle(lm, more, 8)
    assert m["spec_drafted"] > 0  # (n-gram: drafts only where the answer repeats itself)
    knowing = Knowing(want, len(ids))
    spec = Pipeline(
        lm,
        {"prefill": Prefill(), "decode": DecodeLoop(speculative=knowing)},
        kv_memory=4 << 20,
        kv_block_size=BLOCK,
        kv_state_checkpoint_every=EVERY,
    )
    m = spec.run_ids(ids, Request(max_new_tokens=48, ignore_eos=True)).metrics.to_dict()
    assert m["spec_accepted"] == m["spec_drafted"] * 3 // 4 and m["spec_tokens_per_step"] > 3


def test_a_draft_model_with_linear_attention_is_refused_in_one_line(lm):
    with pytest.raises(UserError, match="draft_model has linear-attention layers"):
        Speculative("draft", draft=lm)


def test_a_chat_turn_reuses_the_previous_prompt_up_to_its_reply_header(lm):
    """Qwen3.5's template renders an earlier answer without the empty think block it was
    generated after, so a new turn shares the last prompt only up to its reply header
    (``<|im_start|>assistant``): the state there is kept and reused (blocks of 32 here, so no
    block boundary would serve), and the turn equals ``generate()``."""
    from pipeline.frontends.chat_session import ChatSession

    pipe = Pipeline(
        lm,
        {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()},
        kv_memory=4 << 20,
        kv_block_size=32,
        kv_state_checkpoint_every=1024,
    )
    chat = ChatSession(pipe, max_new_tokens=N, ignore_eos=True)
    first = chat.send("Hello there.")
    header = max(i for i, t in enumerate(first.prompt_ids) if t == lm.tokenizer.convert_tokens_to_ids("<|im_start|>"))
    assert 0 < header < 32  # no block boundary between the start and the header
    second = chat.send("And then?")
    assert second.token_ids == oracle(lm, second.prompt_ids)
    assert second.metrics["kv_reused_tokens"] == header


def test_a_finished_request_frees_its_states_when_dropped(lm):
    """No reference cycle keeps a finished request's cache (and its state slots, which can be
    large) alive until the garbage collector runs."""
    pipe = make_pipe(lm)
    states = pipe.pool.states
    free = states.free_slots
    gc.disable()
    try:
        ctx = pipe.run_ids(words(random.Random(11), lm, 20), Request(max_new_tokens=N, ignore_eos=True))
        assert states.free_slots < free
        del ctx
        pipe.pool.clear_prefix_cache()
        assert states.free_slots == free and pipe.pool.used_blocks == 0
    finally:
        gc.enable()


def test_state_slots_evict_idle_checkpoints_least_recently_used_first(lm):
    """When no slot is free, ``allocate`` takes a registered checkpoint nobody else holds, the one
    idle longest; a held one is never taken, and optional checkpoints leave ``reserved`` alone."""
    from pipeline.kv import OutOfSlots, StateSlots

    slots = StateSlots(make_pipe(lm).pool.states.shape, num_slots=4, devices=[], reserved=1)
    a, b, c = slots.allocate(), slots.allocate(), slots.allocate()
    for digest, slot in ((10, a), (20, b), (30, c)):
        slots.register(digest, slot)
    slots.release(b)
    slots.release(a)  # idle: b, then a
    assert slots.free_slots == 2
    assert slots.allocate() == b and not slots.has(20) and slots.has(10)  # b idle longest
    assert slots.lookup(10) == a and slots.free_slots == 0  # held again: not evictable
    with pytest.raises(OutOfSlots):
        slots.allocate()
    slots.release(a)
    with pytest.raises(OutOfSlots):
        slots.allocate(optional=True)  # the last evictable slot is reserved
    assert slots.allocate() == a and not slots.has(10)
