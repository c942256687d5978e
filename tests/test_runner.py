"""The model runner's eager decode paths: the same tokens whichever way the keys are read (in
bfloat16 the same bits as generate()'s attention), and hooks on the decoder always honoured."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import generate_oracle
from pipeline import Pipeline, Request, load_model
from pipeline.runner import matvec
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
    in_place = []
    alone = attention._attend_alone
    monkeypatch.setattr(attention, "_attend_alone", lambda g, *a: in_place.append(g.span is not None) or alone(g, *a))
    monkeypatch.setattr(attention, "native_decode", lambda *a: False)  # every lone row takes generate()'s call
    pipe = fresh_pipe(lm)
    ids = list(range(40, 80))
    want = generate_oracle(lm, torch.tensor([ids]), N, ignore_eos=True)
    first = pipe.run_ids(ids, Request(max_new_tokens=N, ignore_eos=True))
    assert first.generated == want and in_place and all(in_place), (
        "a fresh pool gives consecutive blocks: read in place"
    )
    in_place.clear()
    second = pipe.run_ids(ids, Request(max_new_tokens=N, ignore_eos=True))  # prefix blocks, then others
    assert second.cache.blocks != list(range(second.cache.blocks[0], second.cache.blocks[0] + len(second.cache.blocks)))
    assert second.generated == want and in_place and not any(in_place), "other blocks: its keys gathered"


@pytest.fixture(scope="module")
def grouped_bf16(tiny_dir, tmp_path_factory) -> Path:
    """A held-out bfloat16 Llama (``save_pretrained``) whose query heads come four to a key/value
    head of 64 dims: a shape where the two forms of a lone row's attention round apart."""
    source = tiny_dir("llama")
    config = AutoConfig.from_pretrained(source)
    config.update(dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64, hidden_size=256))
    out = tmp_path_factory.mktemp("grouped-bf16")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    for path in source.iterdir():
        if path.name.startswith("tokenizer") or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    return out


def test_a_lone_bfloat16_row_attends_bit_for_bit_as_generate(grouped_bf16, monkeypatch):
    """In bfloat16 one rounding apart parts the engine from generate() for good: the query heads
    sharing a key/value head attended as rows of one head rounds otherwise than generate()'s call at
    some lengths. With PyTorch's kernels every attention output of a lone row is generate()'s, in
    place and gathered."""
    lm = load_model(str(grouped_bf16), dtype="bfloat16", quant="none")
    layers = lm.model.model.layers
    seen: list[torch.Tensor] = []  # each attention layer's output for the last token, call by call
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, a, out: seen.append(out[0][0, -1].clone())) for layer in layers
    ]
    in_place = []  # per lone-row attention call: read in place (True) or gathered
    alone = attention._attend_alone
    monkeypatch.setattr(attention, "_attend_alone", lambda g, *a: in_place.append(g.span is not None) or alone(g, *a))
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(matvec=False)}, kv_block_size=8)
    ids, steps = list(range(40, 56)), 112
    try:
        generate_oracle(lm, torch.tensor([ids]), steps, ignore_eos=True)
        want, seen[:] = list(seen), []
        for run in range(2):  # fresh blocks (read in place), then the prefix's and others (gathered)
            pipe.run_ids(ids, Request(max_new_tokens=steps, ignore_eos=True))
            assert in_place and all(in_place) if run == 0 else not all(in_place), "read in place, then gathered"
            assert len(seen) == len(want)
            parted = [i // len(layers) for i, (a, b) in enumerate(zip(seen, want)) if not torch.equal(a, b)]
            assert not parted, f"attention parts from generate() at steps {parted[:5]}"
            seen.clear()
            in_place.clear()
    finally:
        for hook in hooks:
            hook.remove()


def test_with_the_native_kernels_a_lone_row_answers_the_same_wherever_its_blocks_lie(grouped_bf16, monkeypatch):
    """The native attention kernel reads a lone row's keys in place wherever they lie. (It read
    only scattered ones: consecutive blocks took SDPA, and a bfloat16 answer depended on where the
    pool had put the row's blocks: the same prompt, run twice, parted.) On AMX, where the products
    are summed as generate()'s, the row takes generate()'s SDPA call over its keys, read in place
    or gathered: the same bits either way."""
    monkeypatch.setattr(matvec, "MIN_ELEMENTS", 0)  # this model's layers are below the kernels' size
    lm = load_model(str(grouped_bf16), dtype="bfloat16", quant="none")
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_block_size=8)
    seen: list[torch.Tensor] = []  # each decode step's attention outputs, layer by layer

    def keep(module, args, out) -> None:
        if out[0].shape[1] == 1:
            seen.append(out[0].clone())

    hooks = [layer.self_attn.register_forward_hook(keep) for layer in lm.model.model.layers]
    in_place = []  # per lone-row attention call: its blocks consecutive (True) or not
    for name in ("_attend", "_attend_alone"):
        original = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda g, *a, f=original: in_place.append(g.span is not None) or f(g, *a))
    ids, runs = list(range(40, 56)), []
    try:
        for _ in range(2):  # a fresh pool's blocks in order; then the blocks it freed, in another
            pipe.pool.clear_prefix_cache()
            tokens = pipe.run_ids(ids, Request(max_new_tokens=64, ignore_eos=True)).generated
            runs.append((tokens, list(seen), list(in_place)))
            seen.clear()
            in_place.clear()
    finally:
        for hook in hooks:
            hook.remove()
    (first, first_seen, first_place), (second, second_seen, second_place) = runs
    assert all(first_place) and not all(second_place), "in order, then not"
    assert all(torch.equal(a, b) for a, b in zip(first_seen, second_seen)) and len(first_seen) == len(second_seen)
    assert first == second


def test_prompts_prefilled_together_attend_as_each_does_alone(grouped_bf16):
    """Each prefill chunk of a step is attended as it is alone (SDPA's fused causal kernel over its
    own keys): one masked call over them all rounded otherwise in bfloat16, so that a request's
    answer depended on which others were prefilled with it."""
    lm = load_model(str(grouped_bf16), dtype="bfloat16", quant="none")
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_block_size=8)
    first = lm.model.model.layers[0].self_attn  # its inputs are the embeddings: the same bits either way
    seen: list[torch.Tensor] = []
    hook = first.register_forward_hook(lambda m, a, out: seen.append(out[0][0].clone()) and None)
    prompts = [torch.randint(10, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 23, 51)]
    try:
        alone = []
        for ids in prompts:
            pipe.pool.clear_prefix_cache()
            pipe.run_ids(ids, Request(max_new_tokens=1))
            alone.append(seen.pop(0))
        pipe.pool.clear_prefix_cache()
        seen.clear()
        handles = [pipe.submit(Request(max_new_tokens=1), ids=ids, result=False) for ids in prompts]
        [pipe.wait(h) for h in handles]
    finally:
        hook.remove()
    together = seen[0]
    assert together.shape[0] == sum(len(ids) for ids in prompts), "prefilled in one step"
    assert all(torch.equal(a, b) for a, b in zip(alone, together.split([len(ids) for ids in prompts])))


def test_a_hook_on_the_decoder_sees_every_step(lm):
    pipe = fresh_pipe(lm)
    steps = []
    hook = lm.model.get_decoder().register_forward_hook(lambda *args: steps.append(1))
    try:
        pipe.run_ids(list(range(40, 60)), Request(max_new_tokens=N, ignore_eos=True))
    finally:
        hook.remove()
    assert len(steps) == N  # one prefill forward, then N - 1 decode steps
