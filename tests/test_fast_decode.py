"""The fast decode path (static KV cache, compiled step, deferred EOS checks), warm-up and chunked
prefill give exactly the tokens of the plain path and of ``generate(do_sample=False)``.

Compiling with inductor costs tens of seconds on a small CPU, so most compiled tests use the
``aot_eager`` backend: the same graph capture (dynamo over the model and the StaticCache), no
code generation. One test compiles with inductor on the smallest shapes.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image

from conftest import ROOT, generate_oracle
from pipeline import KVCache, Pipeline, Request, UserError
from pipeline.assemble import stages_from_cfg
from stages import DecodeLoop, Prefill, Tokenize
from stages.decode import FastPathFallback

N = 12
CAP = 96  # static cache length for these tests: prompt + N fits


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("qwen3")


@pytest.fixture(scope="module")
def prompt(lm) -> list[int]:
    return lm.tokenizer("The quick brown fox jumps over the lazy dog, again and again.")["input_ids"]


def run_ids(pipe: Pipeline, ids: list[int], cache: KVCache | None = None, n: int = N, **request):
    """Prefill + decode from raw ids (no template) through the pipeline's own stages and spans."""
    return pipe.run_ids(ids, Request(max_new_tokens=n, **{"ignore_eos": True, **request}), cache)


def pipe_of(lm, static: bool = False, chunk: int | None = None, **decode) -> Pipeline:
    return Pipeline(lm, {"prefill": Prefill(chunk), "decode": DecodeLoop(**decode)}, kv_static=static, kv_max_len=CAP)


def oracle(lm, ids: list[int], n: int = N) -> list[int]:
    return generate_oracle(lm, torch.tensor([ids], device=lm.device), n, ignore_eos=True)


def fallbacks(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, FastPathFallback)]


def run_twice(pipe: Pipeline, ids: list[int]):
    """Two runs of the same prompt and the fallback warnings they raised (one is allowed, once)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        a = run_ids(pipe, ids)
        b = run_ids(pipe, ids)
    return a, b, fallbacks(record)


# --- static cache, deferred checks ----------------------------------------------------------

def test_static_cache_with_deferred_checks_equals_plain_and_generate(lm, prompt):
    plain = run_ids(pipe_of(lm), prompt)
    fast = run_ids(pipe_of(lm, static=True, check_every=5), prompt)
    assert fast.cache.is_static
    assert fast.generated == plain.generated == oracle(lm, prompt)
    # Same bookkeeping as the plain path: the last token is not fed, no overshoot kept.
    assert fast.cache.length == fast.cache.cache_length() == len(prompt) + N - 1
    assert fast.cache.keys == plain.cache.keys
    m = fast.metrics.to_dict()
    assert m["decode_tokens"] == N - 1 and m["generated_tokens"] == N
    assert m["stages"]["sample"]["calls"] == N and m["decode_compiled"] is False


@pytest.mark.parametrize("every", [1, 4])
def test_eos_mid_block_is_trimmed(lm, prompt, every):
    free = run_ids(pipe_of(lm), prompt, n=16).generated
    j = 6
    eos = free[j]
    j = free.index(eos)  # the first time that token appears is where EOS stops the plain path
    saved = lm.model.generation_config.eos_token_id
    lm.model.generation_config.eos_token_id = eos
    try:
        plain = run_ids(pipe_of(lm), prompt, n=16, ignore_eos=False)
        fast = run_ids(pipe_of(lm, static=True, check_every=every), prompt, n=16, ignore_eos=False)
    finally:
        lm.model.generation_config.eos_token_id = saved
    assert plain.generated == free[: j + 1] and plain.finish_reason == "eos"
    assert fast.generated == plain.generated and fast.finish_reason == "eos"
    # The steps run past EOS inside the block were dropped from the cache.
    assert fast.cache.length == fast.cache.cache_length() == len(prompt) + j
    assert fast.metrics.to_dict()["decode_tokens"] == j


def test_stop_string_and_streaming_with_deferred_checks(lm, prompt):
    free = run_ids(pipe_of(lm), prompt, n=24)
    text = free.text
    assert len(text) >= 8, "tiny model produced too little text for this test"
    stop = text[4:7]
    plain_pieces: list[str] = []
    fast_pieces: list[str] = []
    plain_pipe, fast_pipe = pipe_of(lm), pipe_of(lm, static=True, check_every=6)
    plain = plain_pipe.context(Request(max_new_tokens=24, ignore_eos=True, stop=[stop]), on_text=plain_pieces.append)
    fast = fast_pipe.context(Request(max_new_tokens=24, ignore_eos=True, stop=[stop]), on_text=fast_pieces.append)
    for pipe, ctx in ((plain_pipe, plain), (fast_pipe, fast)):
        ctx.input_ids = torch.tensor([prompt])
        ctx.token_keys = list(prompt)
        for stage in pipe.stages.values():
            stage(ctx)
    assert fast.finish_reason == plain.finish_reason == "stop"
    assert fast.text == plain.text == text[: text.find(stop)]
    assert fast.generated == plain.generated
    assert "".join(fast_pieces) == "".join(plain_pieces) == fast.text
    assert fast.cache.length == fast.cache.cache_length() == len(prompt) + len(fast.generated) - 1


# --- compiled step ----------------------------------------------------------------------------

def test_compiled_step_equals_plain_and_generate(lm, prompt):
    pipe = pipe_of(lm, static=True, compile=True, compile_backend="aot_eager")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = run_ids(pipe, prompt)
        second = run_ids(pipe, prompt[:-3])  # another prompt on the same shared static cache
    assert fallbacks(record) == []
    assert first.metrics.to_dict()["decode_compiled"] is True
    assert first.generated == run_ids(pipe_of(lm), prompt).generated == oracle(lm, prompt)
    assert second.generated == oracle(lm, prompt[:-3])


def test_inductor_compiled_step_smallest_shapes(lm, prompt):
    """The real code generation once (CPU inductor), on a 32-position cache and 4 new tokens."""
    ids = prompt[:8]
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(compile=True, check_every=2)},
                    kv_static=True, kv_max_len=32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = run_ids(pipe, ids, n=4)
    assert fallbacks(record) == []
    assert got.metrics.to_dict()["decode_compiled"] is True
    assert got.generated == oracle(lm, ids, 4)


def test_dynamic_cache_falls_back_with_one_warning(lm, prompt):
    pipe = pipe_of(lm, static=False, compile=True, compile_backend="aot_eager")
    a, b, messages = run_twice(pipe, prompt)
    assert len(messages) == 1 and "kv.static=true" in messages[0]
    assert a.generated == b.generated == oracle(lm, prompt)
    assert a.metrics.to_dict()["decode_compiled"] is False


def test_compile_error_falls_back_with_one_warning(lm, prompt):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("this backend cannot compile anything")

    pipe = pipe_of(lm, static=True, compile=True, compile_backend=broken_backend)
    a, b, messages = run_twice(pipe, prompt)
    assert len(messages) == 1 and "torch.compile failed" in messages[0]
    assert a.generated == b.generated == oracle(lm, prompt)
    assert a.cache.length == a.cache.cache_length() == len(prompt) + N - 1


def test_nf4_fast_path_falls_back_with_one_warning(load_tiny, prompt):
    lm4 = load_tiny("qwen3", quant="nf4")
    assert lm4.quant == "nf4"
    pipe = pipe_of(lm4, static=True, compile=True)
    a, b, messages = run_twice(pipe, prompt)
    assert len(messages) == 1 and "nf4" in messages[0]
    assert a.generated == b.generated == run_ids(pipe_of(lm4), prompt).generated == oracle(lm4, prompt)


# --- warm-up ----------------------------------------------------------------------------------

def test_warmup_is_reported_apart_and_the_request_compiles_nothing(lm, prompt):
    from torch._dynamo.utils import counters

    pipe = pipe_of(lm, static=True, compile=True, compile_backend="aot_eager")
    assert pipe.warmup_s is None
    seconds = pipe.warmup()
    assert seconds > 0 and pipe.warmup_s == seconds
    assert pipe.stages["decode"]._verified  # the compiled step already ran once
    graphs = counters["stats"]["unique_graphs"]
    ctx = run_ids(pipe, prompt)
    assert counters["stats"]["unique_graphs"] == graphs  # no compile inside the request (so not in TTFT)
    m = pipe.result(ctx).metrics
    assert m["warmup_s"] == seconds and m["decode_compiled"] is True
    assert ctx.generated == oracle(lm, prompt)
    assert ctx.cache.length == len(prompt) + N - 1  # warm-up left nothing in the shared cache


# --- chunked prefill -------------------------------------------------------------------------

@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_prefill_equals_one_shot(lm, prompt, static, chunk):
    one = run_ids(pipe_of(lm, static=static), prompt)
    chunked = run_ids(pipe_of(lm, static=static, chunk=chunk), prompt)
    assert chunked.generated == one.generated == oracle(lm, prompt)
    assert chunked.cache.length == one.cache.length
    torch.testing.assert_close(chunked.logits, one.logits)  # prefill's next-token logits


def test_chunked_prefill_with_3d_positions(load_tiny):
    pytest.importorskip("pipeline.families.qwen2_vl")
    from stages import VisionEncoder

    vl = load_tiny("qwen2-vl")
    rng = np.random.default_rng(7)
    image = Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8), "RGB")
    request = Request(prompt="What is in the picture?", images=[image], max_new_tokens=8, ignore_eos=True)

    def pipe(chunk: int | None, static: bool) -> Pipeline:
        stages = {"tokenize": Tokenize(), "vision_encoder": VisionEncoder(), "prefill": Prefill(chunk),
                  "decode": DecodeLoop(check_every=3 if static else None)}
        return Pipeline(vl, stages, kv_static=static, kv_max_len=256)

    one = pipe(None, False).run(request)
    assert one.metrics["image_tokens"] > 7  # the chunks below cut through the image placeholders
    for chunk, static in ((7, False), (7, True), (1000, True)):
        assert pipe(chunk, static).run(request).token_ids == one.token_ids


# --- KVCache on a static cache -----------------------------------------------------------------

def test_static_kvcache_length_nbytes_rollback(lm, prompt):
    cfg = lm.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = torch.finfo(lm.model.dtype).bits // 8
    per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem

    cache = KVCache(lm.config, static=True, max_cache_len=CAP)
    assert cache.is_static and cache.capacity == CAP and cache.nbytes == 0  # allocated on first write
    pipe = pipe_of(lm, static=True)
    fresh = run_ids(pipe_of(lm), prompt).generated
    assert run_ids(pipe, prompt, cache).generated == fresh
    assert cache.length == cache.cache_length() == len(prompt) + N - 1
    assert cache.nbytes == per_position * CAP  # the whole pre-allocation, whatever the length

    # Rollback into the prompt rewinds in place; what follows is masked, then overwritten.
    cache.rollback(len(prompt) - 5)
    assert cache.length == cache.cache_length() == len(prompt) - 5 and cache.nbytes == per_position * CAP
    other = prompt[:-5] + lm.tokenizer(" cats sleep all day")["input_ids"]
    got = run_ids(pipe, other, cache)
    assert got.generated == run_ids(pipe_of(lm), other).generated
    assert got.metrics.to_dict()["kv_reused_tokens"] == len(prompt) - 5

    # Snapshot / restore branches, and clear() keeps the allocation.
    run_ids(pipe, prompt, cache, n=1)
    snap = cache.snapshot()
    tail = lm.tokenizer(" and then")["input_ids"]
    for _ in range(2):
        cache.restore(snap)
        assert run_ids(pipe, prompt + tail, cache).generated == run_ids(pipe_of(lm), prompt + tail).generated
    cache.clear()
    assert cache.length == 0 and cache.cache_length() == 0 and cache.nbytes == per_position * CAP


def test_static_cache_refuses_what_it_cannot_hold(lm, prompt):
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_static=True, kv_max_len=len(prompt) + 3)
    with pytest.raises(UserError, match="kv.max_len"):
        run_ids(pipe, prompt, n=8)
    with pytest.raises(UserError, match="kv.max_len"):
        run_ids(pipe, prompt + prompt, n=1)
    assert run_ids(pipe, prompt, n=4).generated == oracle(lm, prompt, 4)  # exactly full is fine


# --- config --------------------------------------------------------------------------------------

def test_config_keys_reach_the_stages():
    with initialize_config_dir(config_dir=str(ROOT / "pipeline" / "conf"), version_base=None):
        default = compose(config_name="config")
        fast = compose(config_name="config",
                       overrides=["decode.compile=true", "decode.check_every=4", "prefill.chunk_size=64"])
    assert default.kv.static is False and default.decode.compile is False
    assert fast.kv.static is True  # kv.static follows decode.compile unless set
    stages = stages_from_cfg(fast)
    assert stages["decode"].compile is True and stages["decode"].check_every == 4
    assert stages["prefill"].chunk_size == 64
    assert stages_from_cfg(default)["decode"].compile is False
