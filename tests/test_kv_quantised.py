"""Quantised keys and values (``kv.dtype=int8|fp8``): the quantiser stays within its bound, the
pool holds about twice the tokens, and every engine path (batches with preemption, chunked
prefill, prefix hits, speculative decoding, each family) gives the tokens of a lone fresh run with
the same ``kv.dtype``. Agreement with full precision is measured, not asserted:
``benchmarks/kv_quality.py``."""

from __future__ import annotations

import random

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import LlamaConfig

from conftest import ROOT
from pipeline import Pipeline, Request, UserError
from pipeline.kv.quantised import FORMATS, dequantise, quantise
from pipeline.memory import kv_bytes
from stages import AudioEncoder, DecodeLoop, Prefill, Speculative, Tokenize, VisionEncoder
from test_engine import mixed_requests, submit_staggered, words


def test_int8_round_trip_is_within_half_a_step():
    x = torch.randn(300, 4, 64, dtype=torch.float32) * torch.logspace(-3, 2, 300).view(-1, 1, 1)
    x[7, 2] = 0.0  # an all-zero row: scale 0, no NaN
    x[9, 1, 5] = 40.0  # an outlier sets its row's step
    q, scale = quantise(FORMATS["int8"], x)
    back = dequantise(FORMATS["int8"], q, scale, torch.float32)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and not back.isnan().any()
    step = scale.float().unsqueeze(-1)
    assert bool(((back - x).abs() <= step / 2 + 1e-6 * x.abs()).all())
    assert bool((back[7, 2] == 0).all())


def test_the_scale_is_exact_in_the_model_dtype_and_never_clips():
    x = torch.randn(500, 2, 64, dtype=torch.float32) * torch.logspace(-4, 4, 500).view(-1, 1, 1)
    for fmt in FORMATS.values():
        q, scale = quantise(fmt, x)
        assert bool((scale.float() * fmt.top >= x.abs().amax(-1)).all())  # max|x| fits without clipping
        assert bool((scale.float() * fmt.top <= x.abs().amax(-1) * (1 + 2**-7)).all())  # the step barely grows
        exact = dequantise(fmt, q, scale, torch.float64)
        assert torch.equal(dequantise(fmt, q, scale, torch.float32).double(), exact)


def test_fp8_round_trip_is_within_its_mantissa():
    x = torch.randn(300, 4, 64, dtype=torch.float32) * torch.logspace(-3, 2, 300).view(-1, 1, 1)
    q, scale = quantise(FORMATS["fp8"], x)
    back = dequantise(FORMATS["fp8"], q, scale, torch.float32)
    s = scale.float().unsqueeze(-1)
    # e4m3: 3 mantissa bits (half a step is 2^-4 of the value), subnormals a step of 2^-9 of the scale
    bound = torch.maximum(x.abs() * 2**-4, s * 2**-10) * (1 + 1e-5)
    assert q.dtype == torch.uint8 and bool(((back - x).abs() <= bound).all())


def test_a_quantised_pool_holds_at_least_1_9x_the_tokens_on_real_shapes():
    """Per position and head: head_dim bytes + a 2-byte scale, against 2 bytes an element."""
    for head_dim in (64, 128, 256):
        config = LlamaConfig(
            hidden_size=16 * head_dim,
            num_attention_heads=16,
            num_key_value_heads=4,
            num_hidden_layers=8,
            head_dim=head_dim,
        )
        full = kv_bytes(config, 16, torch.bfloat16)
        for kind in ("int8", "fp8"):
            assert full / kv_bytes(config, 16, torch.bfloat16, kv_dtype=kind) >= 1.9
        assert kv_bytes(config, 16, torch.float32) / kv_bytes(config, 16, torch.float32, kv_dtype="int8") >= 3.7


def test_same_memory_gives_the_pool_the_blocks_its_bytes_allow(load_tiny):
    lm = load_tiny("qwen3")
    memory = 4 << 20
    pools = {
        d: Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=memory, kv_dtype=d).pool
        for d in ("auto", "int8")
    }
    assert pools["int8"].block_bytes < pools["auto"].block_bytes
    for pool in pools.values():
        assert (pool.num_blocks - 1) == memory // pool.block_bytes


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_batch_with_images_and_preemption_equals_each_request_alone(load_tiny, kind):
    """float64: no near-ties; the batch, preempted and recomputed, reads the same stored keys."""
    lm = load_tiny("qwen2-vl", dtype="float64")
    requests = mixed_requests(18, images=True)
    bytes_per_block = kv_bytes(lm.config, 16, lm.model.dtype, kv_dtype=kind)

    def stages() -> dict:
        return {
            "tokenize": Tokenize(),
            "vision_encoder": VisionEncoder(),
            "prefill": Prefill(chunk_size=24),
            "decode": DecodeLoop(),
        }

    pipe = Pipeline(lm, stages(), kv_memory=14 * bytes_per_block, kv_dtype=kind, max_seqs=18, max_batch_tokens=128)
    before = pipe.engine.counters["preemptions"]
    batched = submit_staggered(pipe, requests)
    assert pipe.engine.counters["preemptions"] > before, "the pool was meant to force preemption"
    one = Pipeline(lm, stages(), kv_dtype=kind, max_seqs=1)
    one.pool.clear_prefix_cache()
    for i, (req, res) in enumerate(zip(requests, batched)):
        assert res.token_ids == one.run(req).token_ids, f"request {i}"


@pytest.mark.parametrize("kind, tolerance", [("int8", 0.1), ("fp8", 0.5)])
def test_scores_read_from_a_quantised_pool_stay_close_to_full_precision(load_tiny, kind, tolerance):
    """Chunks after the first attend over keys gathered from the pool and dequantised; a whole
    prefill attends over its own keys as stored: the prompt's log-probabilities are the same
    both ways, and within the quantiser's reach of full precision's (measured on this tiny
    random model: int8 at most 0.06 nats, fp8 0.33; a wrong scale or row is far off both)."""
    lm = load_tiny("qwen3", dtype="float64")
    prompt = words(random.Random(7), 60)

    def scores(kv_dtype: str, chunk: int | None) -> torch.Tensor:
        pipe = Pipeline(
            lm,
            {"tokenize": Tokenize(), "prefill": Prefill(chunk_size=chunk), "decode": DecodeLoop()},
            kv_dtype=kv_dtype,
            max_seqs=1,
        )
        pipe.pool.clear_prefix_cache()
        result = pipe.run(Request(prompt=prompt, max_new_tokens=1, prompt_logprobs=0))
        return torch.tensor([t.logprob for t in result.prompt_logprobs[1:]])

    gathered = scores(kind, 8)
    assert torch.equal(gathered, scores(kind, None))
    gap = (scores("auto", None) - gathered).abs()
    assert 0 < float(gap.max()) < tolerance, float(gap.max())


def test_chunked_prefill_and_prefix_hits_read_the_keys_as_stored(load_tiny):
    """A prompt's own keys are attended as the pool stores them, so a whole prefill, a chunked one
    and one that starts from a prefix hit give the same tokens."""
    lm = load_tiny("qwen3", dtype="float64")
    prompt = words(random.Random(3), 120)

    def run(chunk: int | None, fresh: bool) -> list[int]:
        pipe = Pipeline(
            lm,
            {"tokenize": Tokenize(), "prefill": Prefill(chunk_size=chunk), "decode": DecodeLoop()},
            kv_memory=8 << 20,
            kv_dtype="int8",
        )
        if fresh:
            pipe.pool.clear_prefix_cache()
        result = pipe.run(Request(prompt=prompt, max_new_tokens=12, ignore_eos=True))
        return result.token_ids, result.metrics["kv_reused_tokens"]

    whole, reused = run(None, fresh=True)
    assert reused == 0
    assert run(16, fresh=True) == (whole, 0)
    again, reused = run(None, fresh=False)
    assert again == whole and reused > 0


def test_speculative_decoding_keeps_the_tokens_of_plain_decoding(load_tiny):
    lm = load_tiny("qwen3", dtype="float64")
    request = Request(prompt="one two three one two three one two three one two", max_new_tokens=24, ignore_eos=True)

    def run(spec) -> list[int]:
        pipe = Pipeline(
            lm,
            {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop(speculative=spec)},
            kv_dtype="int8",
            max_seqs=1,
        )
        pipe.pool.clear_prefix_cache()
        return pipe.run(request).token_ids

    assert run(Speculative("ngram")) == run(None)


def test_the_compiled_step_reads_a_quantised_pool_as_eager_does(load_tiny):
    """The graph dynamo captures (aot_eager: the same capture as inductor, no code generation)
    quantises the keys it writes and dequantises the rows it reads, batched and alone."""
    lm = load_tiny("qwen3", dtype="float64")
    rng = random.Random(5)
    prompts = [words(rng, rng.randint(5, 30)) for _ in range(3)]  # one batch size to the end: one graph

    def run(**decode) -> list[list[int]]:
        pipe = Pipeline(
            lm,
            {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop(**decode)},
            kv_memory=1 << 20,
            kv_dtype="int8",
            max_seqs=3,
        )
        pipe.pool.clear_prefix_cache()
        results = [
            h.result(timeout=300)
            for h in [pipe.submit(Request(prompt=p, max_new_tokens=8, ignore_eos=True)) for p in prompts]
        ]
        assert all(r.metrics["decode_compiled"] is bool(decode) for r in results)  # no silent fallback
        return [r.token_ids for r in results]

    assert run(compile=True, compile_backend="aot_eager") == run()


@pytest.mark.parametrize(
    "family", ["gemma3", "qwen3.5", "qwen2-audio", "qwen2.5-vl", "qwen3-vl", "qwen2.5-omni", "llama"]
)
def test_every_family_batches_on_a_quantised_pool(load_tiny, family):
    """Sliding windows (Gemma 3), recurrent states kept in full precision beside int8 keys
    (Qwen3.5), audio placeholders (Qwen2-Audio), each family's positions (M-RoPE, deepstack,
    the thinker): three requests at once equal each alone. (Qwen2-VL with images: above.)"""
    lm = load_tiny(family, dtype="float64")
    stages = {
        "tokenize": Tokenize(),
        "audio_encoder": AudioEncoder(),
        "prefill": Prefill(chunk_size=16),
        "decode": DecodeLoop(),
    }
    rng = random.Random(1)
    requests = [Request(prompt=words(rng, rng.randint(20, 60)), max_new_tokens=8, ignore_eos=True) for _ in range(3)]
    pipe = Pipeline(lm, stages, kv_dtype="int8", max_seqs=3)
    batched = [h.result(timeout=300) for h in [pipe.submit(r) for r in requests]]
    one = Pipeline(lm, stages, kv_dtype="int8", max_seqs=1)
    for req, res in zip(requests, batched):
        one.pool.clear_prefix_cache()
        assert res.token_ids == one.run(req).token_ids


def test_kv_dtype_is_checked(load_tiny):
    from pipeline.cli.settings import check

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        bad = compose("config", overrides=["kv.dtype=int4"])
    with pytest.raises(UserError, match="kv.dtype must be one of auto, int8, fp8") as err:
        check(bad)  # what the CLI runs before the model loads
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="kv.dtype must be one of"):
        Pipeline(load_tiny("qwen3"), {"prefill": Prefill(), "decode": DecodeLoop()}, kv_dtype="float8")
