"""The model runner's eager decode paths: the same tokens whichever way the keys are read, and
hooks on the decoder always honoured."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import generate_oracle
from pipeline import Pipeline, Request
from stages import DecodeLoop, Prefill, Tokenize

attention = sys.modules["pipeline.runner.attention"]
N = 24


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("llama")


def fresh_pipe(lm) -> Pipeline:
    # A pool of its own (kv_block_size 8 keys it apart from other tests'), so blocks come out in order.
    return Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()}, kv_block_size=8)


def test_a_lone_stream_reads_keys_in_place_or_gathered_with_the_same_tokens(lm, monkeypatch):
    calls = []
    in_place = attention._attend_in_place
    monkeypatch.setattr(attention, "_attend_in_place", lambda *a: calls.append(1) or in_place(*a))
    pipe = fresh_pipe(lm)
    ids = list(range(40, 80))
    want = generate_oracle(lm, torch.tensor([ids]), N, ignore_eos=True)
    first = pipe.run_ids(ids, Request(max_new_tokens=N, ignore_eos=True))
    assert first.generated == want and calls, "a fresh pool gives consecutive blocks: read in place"
    calls.clear()
    second = pipe.run_ids(ids, Request(max_new_tokens=N, ignore_eos=True))  # prefix blocks, then others
    assert second.cache.blocks != list(range(second.cache.blocks[0], second.cache.blocks[0] + len(second.cache.blocks)))
    assert second.generated == want and not calls


def test_a_hook_on_the_decoder_sees_every_step(lm):
    pipe = fresh_pipe(lm)
    steps = []
    hook = lm.model.get_decoder().register_forward_hook(lambda *args: steps.append(1))
    try:
        pipe.run_ids(list(range(40, 60)), Request(max_new_tokens=N, ignore_eos=True))
    finally:
        hook.remove()
    assert len(steps) == N  # one prefill forward, then N - 1 decode steps
