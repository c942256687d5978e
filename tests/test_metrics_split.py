"""Memory and bandwidth figures a GPU user reads (issue 26), checked on CPU through the same code:
``peak_memory_bytes`` without the KV pool, which is ``kv_pool_bytes`` of its own; each request's
peak over the steps it took part in, right when requests overlap; ``bandwidth_gb_s`` counting
the keys and values every decode step reads, besides the weights."""

from __future__ import annotations

import pytest
import torch

from pipeline import Pipeline, Request
from pipeline import metrics as metrics_module
from pipeline.metrics import pool_bytes
from pipeline.runner import ModelRunner
from stages import DecodeLoop, Prefill

MiB = 1 << 20
PER_TOKEN = 1000  # simulated activation bytes per token a forward feeds


def pipe_of(lm, **engine) -> Pipeline:
    return Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=2 * MiB, **engine)


@pytest.fixture
def gpu_allocator(monkeypatch):
    """Metrics read as on a GPU: the allocator's peak since the last reset is the pool plus
    ``PER_TOKEN`` bytes per token the last forward fed; synchronising does nothing."""
    state = {"pool": 0, "activations": 0}
    forward = ModelRunner.forward

    def measured(self, chunks):
        out = forward(self, chunks)
        state["pool"] = pool_bytes(self.pool)
        state["activations"] = PER_TOKEN * sum(c.count for c in chunks)
        return out

    monkeypatch.setattr(ModelRunner, "forward", measured)
    monkeypatch.setattr(metrics_module, "_is_cuda", lambda device: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["pool"] + state["activations"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return state


def test_peak_memory_leaves_the_pool_out_and_is_each_requests_own(load_tiny, gpu_allocator):
    """A decodes after a 40-token prefill; B (2 tokens) arrives while A decodes. A keeps its own
    prefill's peak although B started later; B never sees A's prefill; the pool is apart."""
    pipe = pipe_of(load_tiny("qwen3"), burst=1)
    a = pipe.submit(Request(max_new_tokens=10, ignore_eos=True), ids=list(range(5, 45)), result=False)
    tokens = iter(a)
    for _ in range(3):  # A is past its prefill, decoding
        next(tokens)
    b = pipe.submit(Request(max_new_tokens=4, ignore_eos=True), ids=[7, 8], result=False)
    ma, mb = (pipe.result(pipe.wait(h)).metrics for h in (a, b))
    assert ma["peak_memory_bytes"] == 40 * PER_TOKEN
    assert mb["peak_memory_bytes"] == (2 + 1) * PER_TOKEN  # its prefill next to A's decode row
    assert ma["kv_pool_bytes"] == mb["kv_pool_bytes"] == pool_bytes(pipe.pool) > 0


def test_kv_pool_bytes_on_cpu(load_tiny):
    pipe = pipe_of(load_tiny("qwen3"))
    m = pipe.result(pipe.run_ids(list(range(5, 30)), Request(max_new_tokens=4, ignore_eos=True))).metrics
    assert m["kv_pool_bytes"] == pool_bytes(pipe.pool) == pipe.pool.num_blocks * pipe.pool.block_bytes
    assert m["peak_memory_bytes"] > 0


@pytest.mark.parametrize("burst", [1, 8])
def test_bandwidth_counts_every_rows_kv_reads(load_tiny, burst):
    """Decode step j of a P-token prompt reads P + j keys per row: alone, its own; with a second
    row decoding beside it, both rows' (a device reads them all in that step)."""
    pipe = pipe_of(load_tiny("qwen3"), burst=burst)
    prompt, new = list(range(5, 15)), 6
    per_token = pipe.pool.block_bytes / pipe.pool.block_size
    own = sum(len(prompt) + j for j in range(1, new)) * per_token
    solo = pipe.run_ids(prompt, Request(max_new_tokens=new, ignore_eos=True))
    assert solo.metrics.kv_read_bytes == pytest.approx(own)
    m = pipe.result(solo).metrics
    decode = m["stages"]["decode"]
    assert decode["calls"] == new - 1
    assert m["bandwidth_gb_s"] == pytest.approx(
        (m["decode_weights_bytes"] * decode["calls"] + own) / decode["seconds"] / 1e9
    )
    pipe.pool.clear_prefix_cache()
    pair = [pipe.submit(Request(max_new_tokens=new, ignore_eos=True), ids=prompt, result=False) for _ in range(2)]
    assert [pipe.wait(h).metrics.kv_read_bytes for h in pair] == pytest.approx([2 * own, 2 * own])
