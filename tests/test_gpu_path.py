"""The GPU path's host discipline, checked on CPU through the same code: a step waits for the
device at most once, new blocks are zeroed in one call, and the compiled step's bucketed shapes
mean no recompilation after warm-up, whatever the batch size or context length.
"""

from __future__ import annotations

import pytest
import torch

from conftest import generate_oracle, submit_all
from pipeline import Pipeline, Request
from pipeline.kv import BlockPool
from pipeline.runner import flex
from pipeline.runner.forward import BATCH_BUCKETS, batch_bucket, width_bucket
from stages import DecodeLoop, Prefill, Sampler


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("qwen3")


def submit_sizes(pipe: Pipeline, lm, sizes: list[int], new: int, **request) -> list:
    """One request per size (a prompt of that many ordinary tokens), all in flight at once."""
    words = lm.tokenizer(" ".join(["hello world again"] * 800), add_special_tokens=False)["input_ids"]
    return submit_all(pipe, [words[i : i + n] for i, n in enumerate(sizes)], new, **request)


@pytest.mark.parametrize("burst", [8, 1])
def test_a_greedy_batch_step_waits_for_the_device_once(lm, burst):
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=4 << 20)
    pipe.engine.burst = burst
    ctxs = submit_sizes(pipe, lm, [5, 9, 40, 17], 20)
    c = pipe.engine.counters
    assert 1 <= c["blocking_transfers_step_max"] <= 2
    assert c["blocking_transfers"] <= c["steps"]  # one read per step (a burst's steps share one)
    ids = lm.tokenizer(" ".join(["hello world again"] * 800), add_special_tokens=False)["input_ids"]
    assert ctxs[1].generated == generate_oracle(lm, torch.tensor([ids[1:10]]), 20, ignore_eos=True)


def test_sampled_rows_wait_once_too(lm):
    pipe = Pipeline(
        lm, {"prefill": Prefill(), "decode": DecodeLoop(Sampler(temperature=0.7, seed=3))}, kv_memory=4 << 20
    )
    submit_sizes(pipe, lm, [5, 9, 12], 6)
    assert pipe.engine.counters["blocking_transfers_step_max"] <= 2


def test_new_blocks_are_zeroed_together_and_copy_on_write_keeps_them(lm):
    pool = BlockPool(lm.model.config, num_blocks=8, block_size=4, dtype=torch.float32, devices=[])
    pool.prepare_write()
    store = pool.stores[0]
    assert len(pool.stores) == 1 and store.shape[:3] == (2, 2, 8)  # 2 layers, keys/values, blocks
    store.fill_(float("nan"))
    blocks = [pool.allocate() for _ in range(3)]
    pool.prepare_write()
    for b in blocks:
        assert torch.count_nonzero(store[:, :, b]) == 0
    untouched = pool.allocate()
    assert torch.isnan(store[:, :, untouched]).all()  # zeroed at the next forward, not before
    store[:, :, blocks[0]] = 1.5
    pool.copy_block(blocks[0], untouched)
    assert (store[:, :, untouched] == 1.5).all()
    k, _ = pool.layer_kv(1)
    assert k.data_ptr() == store[1, 0].data_ptr()  # every layer a view of the one tensor


def test_buckets_bound_the_shapes():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 9, 17, 33, 64, 65, 200, 300)] == [
        1,
        2,
        4,
        8,
        16,
        24,
        48,
        64,
        96,
        256,
        320,
    ]
    assert [width_bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [2, 2, 4, 8, 64, 128]


@pytest.mark.slow  # suite time; test_compiled checks the same for batches of 1 to 5; gpu_check runs it
def test_no_recompilation_after_warmup_for_any_batch_or_context(lm, request):
    from torch._dynamo.utils import counters

    pipe = Pipeline(
        lm,
        {"prefill": Prefill(), "decode": DecodeLoop(compile=True, compile_backend="aot_eager")},
        kv_memory=64 << 20,
        max_seqs=64,
    )
    pipe.warmup()
    graphs = counters["stats"]["unique_graphs"]
    torch._logging.set_logs(recompiles=True)  # a failure's captured log says why dynamo recompiled
    request.addfinalizer(torch._logging.set_logs)
    for sizes in ([3], [4] * 2, [5, 6, 7], [8] * 17, [3] * 64, [2000, 9]):
        ctxs = submit_sizes(pipe, lm, sizes, 10)
        assert all(len(c.generated) == 10 for c in ctxs)
    # sampled rows take single compiled steps, not bursts: warmed up as well
    submit_sizes(pipe, lm, [4] * 5 + [1500], 4, sampler=Sampler(temperature=0.8, seed=1))
    assert counters["stats"]["unique_graphs"] == graphs, f"recompiled (FlexAttention: {flex.KERNEL.broken})"
    # What CUDA graphs are captured for: a few bucketed shapes, not one per batch size and length.
    shapes = pipe.stages["decode"].compiled.shapes
    block = pipe.pool.block_size
    assert all(b in BATCH_BUCKETS and width_bucket(k // block) == k // block for b, k in shapes)
    assert len(shapes) <= 12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_step_synchronises_at_most_twice(load_tiny):
    import warnings

    lm = load_tiny("qwen3")
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=8 << 20)
    pipe.engine.burst = 1
    submit_sizes(pipe, lm, [5, 9], 2)  # allocate, warm
    handles = [
        pipe.submit(Request(max_new_tokens=12, ignore_eos=True), ids=[5, 6, 7, 8 + i], result=False) for i in range(4)
    ]
    pipe.engine.step()  # the prefill
    steps = 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            while pipe.engine.scheduler.running and steps < 8:
                pipe.engine.step()
                steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for h in handles:
        pipe.wait(h)
    syncs = [w for w in record if "synchroniz" in str(w.message).lower()]
    where = sorted({f"{w.filename}:{w.lineno}" for w in syncs})
    assert steps == 8 and len(syncs) <= 2 * steps, f"{len(syncs)} synchronising calls, at {where}"


def _resident() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_a_long_chunk_over_a_long_context_builds_no_score_matrix(lm):
    """A 4,096-token prefill chunk over 12k cached tokens: fused causal attention (no [q, keys]
    mask or scores), exact. One float score matrix of one head would be 256 MiB here; the
    request's ``peak_memory_bytes`` (the process's peak over its steps, the pool apart) grows by
    its activations over what was resident before it (measured: 55 MiB alone, up to 153 MiB late
    in a full suite run, whose earlier tests leave threads and allocator state behind: the
    high-water mark is the whole process's; 308 MiB with the mask the chunk used to build)."""
    ids = torch.randint(100, 250, (16384,), generator=torch.Generator().manual_seed(0)).tolist()
    pipe = Pipeline(lm, {"prefill": Prefill(4096), "decode": DecodeLoop()}, kv_memory=64 << 20, max_batch_tokens=4096)
    pipe.run_ids(ids[:12288], Request(max_new_tokens=1, ignore_eos=True))  # the context, now in the prefix cache
    before = _resident() - pipe.pool.used_blocks * pipe.pool.block_bytes
    ctx = pipe.run_ids(ids, Request(max_new_tokens=3, ignore_eos=True))
    m = pipe.result(ctx).metrics
    added = m["peak_memory_bytes"] - before
    assert m["prefill_tokens"] == 4096
    assert added < 224 << 20, f"the chunk added {added >> 20} MiB"  # one head's scores alone: 256
    assert ctx.generated == generate_oracle(lm, torch.tensor([ids]), 3, ignore_eos=True)


def test_a_step_out_of_device_memory_is_retried_smaller(lm, monkeypatch):
    """A simulated out-of-memory error in a large step: its sequences are preempted and come
    back, later steps take half the tokens, and every answer is what it is alone."""
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=4 << 20, max_batch_tokens=256)
    engine = pipe.engine
    real, failed = engine.runner.forward, []

    def forward(chunks):
        if sum(c.count for c in chunks) > 100 and not failed:
            failed.append(len(chunks))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(chunks)

    monkeypatch.setattr(engine.runner, "forward", forward)
    sizes = [60, 70, 80]
    ctxs = submit_sizes(pipe, lm, sizes, 6)
    assert failed and engine.counters["oom_retries"] == 1 and engine.scheduler.max_batch_tokens == 128
    words = lm.tokenizer(" ".join(["hello world again"] * 800), add_special_tokens=False)["input_ids"]
    for i, (ctx, n) in enumerate(zip(ctxs, sizes)):
        assert ctx.generated == generate_oracle(lm, torch.tensor([words[i : i + n]]), 6, ignore_eos=True)
    assert sum(pipe.result(c).metrics.get("oom_retries", 0) for c in ctxs) >= 1


def test_out_of_memory_in_a_step_that_cannot_shrink_fails_it_alone(lm, monkeypatch):
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=4 << 20, max_batch_tokens=16)

    def forward(chunks):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(pipe.engine.runner, "forward", forward)
    handle = pipe.submit(Request(max_new_tokens=2, ignore_eos=True), ids=[5, 6, 7], result=False)
    with pytest.raises(torch.OutOfMemoryError):
        pipe.wait(handle)
