"""FlexAttention over the paged pool (``kv.attention``): the same tokens as attention over
gathered keys, for every family, batched, chunked, cached, through sliding windows, Gemma 3's
image blocks and Qwen2-VL's M-RoPE positions.

Most tests run FlexAttention's reference implementation (``KERNEL.unfused``): it applies the
mask function to every key of the pool extent, not only to the blocks the block mask lists, so
tokens equal to SDPA's mean the masks alone are exact (a key of another row, the null block, a
key past the window would each change them). One test runs the compiled CPU kernel where it
compiles; one breaks it and checks the fallback.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import Pipeline, Request
from pipeline.errors import UserError
from pipeline.kv import BlockPool
from pipeline.runner import flex
from pipeline.testing.registry import FAMILIES
from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder


@pytest.fixture(autouse=True)
def poisoned_pools(monkeypatch):
    """Every pool starts as NaN, as reused memory may (a fresh page reads as zeros, which hid a
    bug: FlexAttention weighed never-written blocks, and a weight of 0 times NaN is NaN)."""
    allocate = BlockPool._allocate

    def allocate_poisoned(pool):
        allocate(pool)
        for store in pool.stores:
            store.fill_(float("nan"))

    monkeypatch.setattr(BlockPool, "_allocate", allocate_poisoned)


@pytest.fixture
def kernel(monkeypatch):
    """A fresh process-wide kernel for the test (broken state and compiled function its own)."""
    fresh = flex.FlexKernel()
    monkeypatch.setattr(flex, "KERNEL", fresh)
    return fresh


@pytest.fixture
def unfused(kernel):
    kernel.unfused = True
    return kernel


def run_batch(lm, attention: str, prompts: list[list[int]], n: int = 12, **engine) -> list[list[int]]:
    """Greedy tokens of ``prompts`` submitted together (then again: the second wave starts from the
    prefix cache and decodes next to rows still prefilling)."""
    pipe = Pipeline(
        lm,
        {"prefill": Prefill(), "decode": DecodeLoop()},
        kv_memory=16 << 20,
        max_seqs=8,
        kv_attention=attention,
        **engine,
    )
    out = []
    for _ in range(2):
        handles = [pipe.submit(Request(max_new_tokens=n, ignore_eos=True), ids=p, result=True) for p in prompts]
        out.append([h.result().token_ids for h in handles])
    pipe.pool.clear_prefix_cache()
    return out


def prompts(lm, count: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = min(lm.config.get_text_config().vocab_size, 200)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(count)]


@pytest.mark.parametrize("family", FAMILIES)
def test_flex_masks_give_the_gathered_tokens_for_every_family(load_tiny, unfused, family):
    lm = load_tiny(family)
    ps = prompts(lm)
    # 24-token steps: prompts split into chunks, several chunks per step next to decode rows.
    assert run_batch(lm, "flex", ps, max_batch_tokens=24) == run_batch(lm, "sdpa", ps, max_batch_tokens=24)
    assert unfused.broken is None


def picture(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize("family", ["gemma3", "qwen2-vl"])
def test_flex_with_images_windows_and_mrope(load_tiny, unfused, family):
    """Gemma 3: image blocks attended both ways inside an 8-token sliding window; Qwen2-VL: 3-D
    rope positions. Chunks of 16 tokens end inside neither (the engine's rule) but cut the prompt."""
    lm = load_tiny(family)
    images = [picture(160, 120, 1), picture(64, 64, 3)]

    def answers(attention: str) -> list[list[int]]:
        stages = {
            "tokenize": Tokenize(),
            "vision_encoder": VisionEncoder(),
            "prefill": Prefill(chunk_size=16),
            "decode": DecodeLoop(),
        }
        pipe = Pipeline(lm, stages, kv_memory=16 << 20, kv_attention=attention)
        asks = [
            Request(
                prompt=f"What is in picture {i}? Say it in many words.",
                images=images[: 1 + i % 2],
                max_new_tokens=10,
                ignore_eos=True,
            )
            for i in range(4)
        ]
        handles = [pipe.submit(r) for r in asks]
        out = [h.result().token_ids for h in handles]
        pipe.pool.clear_prefix_cache()
        return out

    assert answers("flex") == answers("sdpa")


# suite time (25 s of Inductor's C++ template); the masks' exactness runs unfused above; gpu_check runs it
@pytest.mark.slow
def test_compiled_cpu_kernel_reads_the_pool_in_place(load_tiny, kernel):
    """The real kernel (inductor's C++ FlexAttention template) for a batch of decode rows: the
    same tokens, and it did not fall back."""
    lm = load_tiny("qwen3")
    ps = prompts(lm, seed=1)
    assert run_batch(lm, "flex", ps) == run_batch(lm, "sdpa", ps)
    assert kernel.broken is None, kernel.trace  # on CUDA: Triton's kernel (first failed there, on an H100)


def test_a_failing_kernel_falls_back_in_one_line(load_tiny, kernel, monkeypatch, capsys):
    lm = load_tiny("qwen3")
    ps = prompts(lm, seed=2)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this\nsecond line")

    monkeypatch.setattr(kernel, "_compiled", {False: broken, True: broken})  # dynamic and static shapes
    with pytest.warns(flex.FlexFallback):
        got = run_batch(lm, "flex", ps)
    assert got == run_batch(lm, "sdpa", ps)
    lines = [line for line in capsys.readouterr().err.splitlines() if "kv.attention" in line]
    assert lines == [
        "mm-pipeline: kv.attention=flex: FlexAttention failed (RuntimeError: no kernel for this); "
        "attention gathers each row's keys instead"
    ]


def test_auto_is_flex_on_cuda_and_sdpa_on_cpu(load_tiny, kernel):
    lm = load_tiny("qwen3")
    pool = BlockPool(lm.model.config, num_blocks=8, block_size=4, dtype=torch.float32, devices=[])
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pool.attention == "auto"
    assert not flex.usable(pool, cpu) and flex.usable(pool, cuda) and flex.usable_for_prefill(pool, cuda)
    pool.attention = "flex"
    assert flex.usable(pool, cpu) and not flex.usable_for_prefill(pool, cpu)
    pool.attention = "sdpa"
    assert not flex.usable(pool, cuda)
    pool.attention, pool.dtype = "flex", torch.float64  # no FlexAttention kernel for float64
    assert not flex.usable(pool, cpu)


def test_attention_setting_is_checked(load_tiny):
    from hydra import compose, initialize_config_dir

    from conftest import ROOT
    from pipeline.cli.settings import check

    with pytest.raises(UserError, match="kv_attention must be one of auto, flex, sdpa"):
        Pipeline(load_tiny("qwen3"), {"prefill": Prefill(), "decode": DecodeLoop()}, kv_attention="paged")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        bad = compose("config", overrides=["kv.attention=paged"])
    with pytest.raises(UserError, match="kv.attention must be one of auto, flex, sdpa"):
        check(bad)
