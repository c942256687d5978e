"""Batched bfloat16 products on oneDNN's prepacked weights (pipeline.runner.packed), on CPUs
with native bfloat16 matmuls: the same numbers as PyTorch's linear up to the order of the sums,
a changed weight is the one read, too little RAM falls back, and engine tokens equal generate()."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import generate_oracle, kernel_calls, submit_all
from pipeline import Pipeline
from pipeline.runner import matvec, packed
from stages import DecodeLoop, Prefill

pytestmark = [
    pytest.mark.skipif(matvec.load() is not None, reason=f"native kernel unavailable: {matvec.load()}"),
    pytest.mark.skipif(not packed.SUPPORTED, reason="this CPU has no native bfloat16 matmuls (AMX / AVX-512 BF16)"),
]


@pytest.fixture(autouse=True)
def any_size(monkeypatch):
    """The tiny shapes here are below the size the engine's wrapper takes by default."""
    monkeypatch.setattr(matvec, "MIN_ELEMENTS", 0)


def close_to_float(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``got`` is the float32-accumulated product rounded once to bfloat16, up to the order of the sums."""
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("bias", [False, True])
def test_many_rows_take_the_packed_weight_and_round_like_linear(bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 384, bias=bias).to(torch.bfloat16)
    matvec.attach(layer)
    x = torch.randn(3, 7, 256, dtype=torch.bfloat16)  # 21 rows, two leading dimensions
    with matvec.active():
        got = layer(x)
    assert got.shape == (3, 7, 384) and got.dtype == torch.bfloat16
    assert packed._PACKED[layer.weight][1] is not None  # it ran on a packed copy
    copy.deepcopy(layer)  # the packed copy is not part of the layer (oneDNN's tensors cannot be copied)
    close_to_float(got, x, layer.weight, layer.bias)
    few = x[0, : matvec.MANY_ROWS - 1]
    with matvec.active():  # below MANY_ROWS: PyTorch's own product
        assert torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # not active (generate()): untouched


def test_a_changed_weight_is_packed_again():
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 256, bias=False).to(torch.bfloat16)
    matvec.attach(layer)
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    with matvec.active():
        before = layer(x)
        with torch.no_grad():
            layer.weight.mul_(-1)  # in place: the version counter moves
        flipped = layer(x)
        layer.weight = torch.nn.Parameter(torch.randn(256, 128, dtype=torch.bfloat16))  # a new tensor
        replaced = layer(x)
    assert torch.equal(flipped, -before)
    close_to_float(replaced, x, layer.weight, None)


def test_too_little_ram_keeps_the_unpacked_product(monkeypatch, capsys):
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 256).to(torch.bfloat16)
    matvec.attach(layer)
    monkeypatch.setattr(packed, "available_ram", lambda: int(packed.FLOOR * packed.total_ram()))
    packed._say_once.cache_clear()
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    with matvec.active():
        got = layer(x)
        again = layer(x)
    assert torch.equal(got, F.linear(x, layer.weight, layer.bias)) and torch.equal(again, got)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "too little RAM for prepacked bfloat16 weights" in err


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_batched_bfloat16_engine_on_packed_weights_matches_generate(tiny_dir, family):
    from pipeline import load_model

    lm = load_model(str(tiny_dir(family)), dtype="bfloat16")
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()})
    vocab = lm.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 23, 14, 31)]
    got = submit_all(pipe, prompts, 10)
    assert any((packed._PACKED.get(p) or (0, None))[1] is not None for p in lm.model.parameters())
    for ids, c in zip(prompts, got):
        assert list(c.generated) == generate_oracle(lm, torch.tensor([ids]), 10, ignore_eos=True)


def test_the_compiled_step_calls_the_packed_product_and_matches_generate(tiny_dir, monkeypatch):
    """Inside a compiled step the packed product is an op of the graph (oneDNN's packed tensors
    cannot enter one), and so is the decode attention (the native kernel; on AMX, where bfloat16
    products are summed as generate()'s, each row over its own keys by generate()'s call); its
    batched tokens equal generate()'s. aot_eager: the same graph capture as inductor, no code
    generation."""

    from pipeline import load_model

    rows = []
    linear = packed.linear

    def counted(x, *args):
        rows.append(x.numel() // x.shape[-1])
        return linear(x, *args)

    monkeypatch.setattr(packed, "linear", counted)
    lm = load_model(str(tiny_dir("qwen3")), dtype="bfloat16")
    pipe = Pipeline(
        lm, {"prefill": Prefill(), "decode": DecodeLoop(compile=True, compile_backend="aot_eager")}, kv_memory=1 << 20
    )
    prompts = [list(range(5, 5 + n)) for n in (6, 11, 17)]
    op = "mm_pipeline::rows_as_alone" if matvec.amx() else "mm_pipeline::decode_attention"
    got, attention_calls = kernel_calls(lambda: submit_all(pipe, prompts, 6), op)
    assert all(c.metrics.info["decode_compiled"] for c in got) and attention_calls > 0
    assert min(rows) < matvec.MANY_ROWS  # a decode step of 3 rows (bucket 4): only the compiled step packs so few
    for ids, c in zip(prompts, got):
        assert list(c.generated) == generate_oracle(lm, torch.tensor([ids]), 6, ignore_eos=True)
