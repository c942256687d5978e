"""The native one-row linear kernel (pipeline.runner.matvec): same numbers as PyTorch's linear,
used by the engine's one-sequence steps only, and greedy tokens equal to stock generate()."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import generate_oracle
from pipeline import Pipeline, Request
from pipeline.runner import matvec
from stages import DecodeLoop, Prefill, Sampler, Tokenize

pytestmark = [
    pytest.mark.skipif(matvec.load() is not None, reason=f"native kernel unavailable: {matvec.load()}"),
    pytest.mark.usefixtures("split_threads"),  # the kernel splits rows between threads
]


@pytest.fixture(autouse=True)
def any_size(monkeypatch):
    """The tiny shapes here are below the size the kernel takes by default (MIN_ELEMENTS)."""
    monkeypatch.setattr(matvec, "MIN_ELEMENTS", 0)


def _isas() -> list[str]:
    """The instruction sets this CPU can run the kernel on (AVX2 always; AVX-512 where it has it)."""
    if matvec.load() is not None:
        return []
    default, found = matvec.isa(), []
    for name in ("avx2", "avx512"):
        try:
            found.append(matvec.isa(name))
        except RuntimeError:  # no AVX-512 here
            pass
    matvec.isa(default)
    return found


@pytest.fixture(params=_isas())
def isa(request):
    """Each instruction-set path of the kernel this CPU has, the default one restored after."""
    default = matvec.isa()
    matvec.isa(request.param)
    yield request.param
    matvec.isa(default)


@pytest.fixture
def fresh(tiny_dir):
    """A tiny model of its own: the kernel wraps its layers, the session's shared ones stay as they are."""
    from pipeline import load_model

    return lambda family, **kwargs: load_model(str(tiny_dir(family)), **kwargs)


def counting(monkeypatch) -> list[int]:
    """Counts the kernel's calls (a wrapper around the registered op)."""
    calls = [0]
    run = matvec.run

    def counted(*args):
        calls[0] += 1
        return run(*args)

    monkeypatch.setattr(matvec, "run", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1000, 1024), (7, 48), (33, 192)])  # rows not a multiple of 4; K not one of 64
def test_one_row_equals_torch_linear(dtype, bias, shape, isa):
    torch.manual_seed(0)
    layer = torch.nn.Linear(shape[1], shape[0], bias=bias).to(dtype)
    x = torch.randn(1, 1, shape[1]).to(dtype)
    expected = layer(x)
    assert matvec.attach(layer) == 1
    with matvec.active():
        got = layer(x)
    assert got.shape == expected.shape and got.dtype == dtype
    # float32: summation order only; bfloat16: at most one rounding step of the output
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("shape", [(256, 512), (1002, 1024)])  # rows in blocks of four, and two left over
def test_int8_row_scales_round_like_torchao(shape, isa):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(shape[1], shape[0], bias=True)).to(torch.bfloat16)
    quantize_(layer, Int8WeightOnlyConfig())
    x = torch.randn(1, shape[1], dtype=torch.bfloat16)
    expected = layer(x)
    assert matvec.plain_weights(layer[0]) is not None
    matvec.attach(layer)
    with matvec.active():
        got = layer(x)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=8e-3)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weights", ["int8", "bfloat16"])
def test_a_bfloat16_row_is_rounded_bit_for_bit_as_pytorch_rounds_it(weights, bias, isa):
    """Small whole numbers make every dot product exact in float32, so only the output's
    roundings are left to compare, bit for bit: torchao's for int8 (the product rounded, times
    the scale rounded, plus the bias rounded), one rounding of the sum with the bias for bfloat16
    weights. 1,002 rows: blocks of sixteen rounded together and the rows left over."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(1024, 1002, bias=bias))
    with torch.no_grad():
        layer[0].weight.copy_(torch.randint(-127, 128, layer[0].weight.shape))
    layer = layer.to(torch.bfloat16)
    if weights == "int8":
        quantize_(layer, Int8WeightOnlyConfig())
    x = torch.randint(-8, 9, (1, 1024)).to(torch.bfloat16)
    if weights == "int8":
        expected = layer(x)
    else:  # the exact sum (float64) plus the bias, rounded once
        w = layer[0].weight.double()
        exact = x.double() @ w.T + (layer[0].bias.double() if bias else 0)
        expected = exact.float().to(torch.bfloat16)
    matvec.attach(layer)
    with matvec.active():
        got = layer(x)
    assert torch.equal(got, expected)


needs_amx = pytest.mark.skipif(not matvec.amx(), reason="no AMX-BF16 tiles on this CPU")


@needs_amx
@pytest.mark.parametrize("copy", ["laid out", "none (RAM short)"])
@pytest.mark.parametrize("weights", ["int8", "bfloat16"])
def test_bfloat16_rows_sum_in_the_order_of_pytorchs_call(weights, copy, monkeypatch, capsys):
    """A bfloat16 row's products are summed in the order of oneDNN's AMX matmul, the one
    ``generate()`` calls: the same bits on inputs where other orders part (1,000 rows: a group of
    128 and the rows left over; a batch's rows each as alone). On the weights' laid-out copy, or,
    where RAM is short for it, on the tiles (said once)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    if copy != "laid out":
        monkeypatch.setattr(matvec, "available_ram", lambda: 0)
        matvec._short_of_ram.cache_clear()
    rows = 3 if weights == "int8" else 1  # a float weight takes the kernel for one row only
    x, w = matvec.cancelling(1000, 1280, seed=0, rows=rows)
    layer = torch.nn.Sequential(torch.nn.Linear(1280, 1000, bias=True)).to(torch.bfloat16)
    with torch.no_grad():
        layer[0].weight.copy_(w)
    if weights == "int8":
        quantize_(layer, Int8WeightOnlyConfig())
    expected = torch.cat([layer(x[r : r + 1]) for r in range(rows)])  # PyTorch's call, a row at a time
    assert matvec.attach(layer) == 1
    assert (layer[0]._mm_matvec[0][2] is None) == (copy != "laid out") and layer[0]._mm_matvec[0][3] == 1
    with matvec.active():
        assert torch.equal(layer(x), expected)
        weight, scale, _, _ = layer[0]._mm_matvec[0]
        try:  # the row kernel's order (AVX-512 or AVX2 lanes, then their sum) parts on these inputs
            matvec.amx(False)
            assert not torch.equal(matvec.run(x, weight, scale, layer[0].bias), expected)
        finally:
            matvec.amx(True)
    assert ("too little RAM" in capsys.readouterr().err) == (copy != "laid out")


@needs_amx
def test_a_long_row_is_summed_in_the_blocks_onednn_splits_it_into():
    """Past some K oneDNN splits a row's columns into blocks, sums each and adds the sums (how many
    its heuristic picks by shape and threads): the number is found per shape at attach and the
    kernel sums in it, bit for bit. 896 x 4,864: Qwen2.5-0.5B's down projection (2 blocks on 2
    threads)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    x, w = matvec.cancelling(896, 4864, seed=5)
    layer = torch.nn.Sequential(torch.nn.Linear(4864, 896, bias=False)).to(torch.bfloat16)
    with torch.no_grad():
        layer[0].weight.copy_(w)
    quantize_(layer, Int8WeightOnlyConfig())
    expected = layer(x)
    matvec.attach(layer)
    weight, scale, laid_out, blocks = layer[0]._mm_matvec[0]
    assert blocks is not None and laid_out is not None
    with matvec.active():
        assert torch.equal(layer(x), expected)
    for other in {1, blocks + 1} - {blocks}:  # another split parts on these inputs
        assert not torch.equal(matvec.run(x, weight, scale, None, laid_out, other), expected)


@needs_amx
def test_the_split_found_is_kept_in_the_cache_folder_for_the_next_process(tmp_path, monkeypatch):
    from pipeline.runner.inductor_cache import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    matvec.onednn_blocks.cache_clear()
    assert matvec.onednn_blocks(256, 4864, torch.int8, 3) == matvec.find_blocks(256, 4864, torch.int8)
    assert (tmp_path / matvec.BLOCKS_FILE).is_file()
    matvec.onednn_blocks.cache_clear()  # as in a new process: read back, not found again
    monkeypatch.setattr(matvec, "find_blocks", lambda *a: pytest.fail("found again"))
    assert matvec.onednn_blocks(256, 4864, torch.int8, 3) is not None
    matvec.onednn_blocks.cache_clear()


@pytest.mark.parametrize("weights", ["int8", "float32", "bfloat16"])
def test_a_row_has_the_same_bits_on_any_number_of_threads(weights, isa):
    """The threads take rows in chunks as they finish (``in_chunks``): which thread reads a row
    varies from call to call, its bits must not (1,002 rows: chunks and the groups of four that
    ``dot4`` reads end mid-matrix)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    dtype = torch.bfloat16 if weights == "bfloat16" else torch.float32
    layer = torch.nn.Sequential(torch.nn.Linear(1024, 1002, bias=True)).to(dtype)
    if weights == "int8":
        quantize_(layer, Int8WeightOnlyConfig())
    matvec.attach(layer)
    x = torch.randn(1, 1024, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 1, 2):
            torch.set_num_threads(n)
            with matvec.active():
                results.append(layer(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_of_a_batch_equal_their_solo_rows_and_many_rows_equal_torchao(dtype, isa):
    """torchao widens the whole int8 weight for any call of more than one row (a batched decode
    step: 3-14x the one-row kernel's time). Up to 16 rows each row goes through the one-row
    kernel, bit for bit what it gives alone; beyond that, torchao's own arithmetic, bit for bit."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(512, 256, bias=True)).to(dtype)
    quantize_(layer, Int8WeightOnlyConfig())
    matvec.attach(layer)
    for rows in (2, 5, 16):
        x = torch.randn(1, rows, 512, dtype=dtype)  # [batch, tokens, features], as a decode step has it
        with matvec.active():
            together = layer(x)
            alone = torch.cat([layer(x[:, r : r + 1]) for r in range(rows)], dim=1)
        assert together.shape == (1, rows, 256) and torch.equal(together, alone)
        torch.testing.assert_close(together, layer(x), atol=2e-2, rtol=8e-3)  # torchao's, not active
    x = torch.randn(17, 512, dtype=dtype)
    with matvec.active():
        many = layer(x)
    assert torch.equal(many, layer(x))


def test_only_active_one_row_calls_take_the_kernel(monkeypatch):
    layer = torch.nn.Linear(64, 32)
    matvec.attach(layer)
    calls = counting(monkeypatch)
    layer(torch.randn(1, 64))  # not active: generate() and every other caller
    with matvec.active():
        layer(torch.randn(3, 64))  # three rows: PyTorch's GEMM
        assert calls[0] == 0
        layer(torch.randn(1, 1, 64))
    assert calls[0] == 1
    with matvec.active():  # another thread meanwhile is not affected
        seen = []
        worker = threading.Thread(target=lambda: seen.append(layer(torch.randn(1, 64))))
        worker.start()
        worker.join()
    assert calls[0] == 1 and seen


def test_a_replaced_weight_is_the_one_read(monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 64)
    matvec.attach(layer)
    calls = counting(monkeypatch)
    x = torch.randn(1, 512)
    layer.weight = torch.nn.Parameter(torch.randn(64, 512))
    with matvec.active():
        got = layer(x)
    assert calls[0] == 1
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn(512, 64).t())  # not contiguous: the kernel cannot read it
    with matvec.active():
        got = layer(x)
    assert calls[0] == 1 and torch.equal(got, torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_a_wrapped_layer_prints_saves_and_copies_as_the_plain_layer(monkeypatch):
    """A user's ``print(model)``, ``torch.save(model)`` and ``copy.deepcopy(model)`` after an engine
    ran it: the same printout, and a plain layer back (attached again where an engine runs it)."""
    import copy
    import io

    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32))
    printed = repr(layers)
    assert matvec.attach(layers) == 2 and repr(layers) == printed
    buffer = io.BytesIO()
    torch.save(layers, buffer)
    buffer.seek(0)
    x = torch.randn(1, 64)
    for back in (torch.load(buffer, weights_only=False), copy.deepcopy(layers)):
        assert all(type(layer) is torch.nn.Linear and "_mm_matvec" not in layer.__dict__ for layer in back)
        assert torch.equal(back(x), layers(x))
        calls = counting(monkeypatch)
        assert matvec.attach(back) == 2
        with matvec.active():
            back(x)
        assert calls[0] == 2


def test_a_compiled_call_reaches_a_wrapped_layer_by_one_path():
    """The wrapper is the layer's class's forward, not an object the instance holds: Dynamo
    guarded what it holds (the layer again, its bound forward, the weights it reads): 22
    guards a layer here against 11; a 254M Llama's cached compile took 2.2 s longer."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(64, 96), torch.nn.Linear(96, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(self.up(x))

    def step(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block(x)

    block = Block()
    matvec.attach(block)
    with torch.inference_mode(), matvec.active():
        torch.compile(step, backend="eager")(block, torch.randn(1, 64))
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    (entry,) = _debug_get_cache_entry_list(step.__code__)
    parts = entry.guard_manager.code_parts
    assert any("_mm_matvec" in part for part in parts)  # the trace went through the wrapper
    assert all("forward" not in layer.__dict__ for layer in (block.up, block.down))
    assert not any(f"._modules['{name}'].forward" in part for name in ("up", "down") for part in parts)


def test_under_accelerate_hooks_the_inner_forward_is_wrapped(monkeypatch):
    from accelerate.hooks import ModelHook, add_hook_to_module

    layer = torch.nn.Linear(64, 96)
    add_hook_to_module(layer, ModelHook())
    assert matvec.attach(layer) == 1 and type(layer) is torch.nn.Linear
    calls = counting(monkeypatch)
    x = torch.randn(1, 64)
    with matvec.active():
        got = layer(x)
    assert calls[0] == 1 and torch.allclose(got, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_weights_it_cannot_read_or_that_are_too_small_keep_their_forward(monkeypatch):
    odd = torch.nn.Linear(20, 8)  # in_features not a multiple of 16
    half = torch.nn.Linear(64, 8).half()
    assert matvec.plain_weights(odd) is None and matvec.plain_weights(half) is None
    assert matvec.attach(torch.nn.Sequential(odd, half)) == 0
    monkeypatch.undo()  # the default size floor: a tiny model's matrices are left to PyTorch, the kernel not even built
    small, large = torch.nn.Linear(128, 536), torch.nn.Linear(1024, 256)
    assert matvec.plain_weights(small) is None and matvec.plain_weights(large) is not None
    assert not matvec.ready(torch.nn.Sequential(small))


def test_small_int8_layers_take_it_only_in_a_model_it_serves(monkeypatch):
    """Below the size floor an int8 layer takes the kernel where the model has a large layer
    (a compiled step would otherwise round it otherwise); a model of only small ones (the
    embedded default) is left to PyTorch unwrapped."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    monkeypatch.undo()  # the default size floor
    small = torch.nn.Sequential(torch.nn.Linear(128, 256))
    quantize_(small, Int8WeightOnlyConfig())
    assert not matvec.ready(small) and "_mm_matvec" not in small[0].__dict__
    served = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(1024, 256))
    quantize_(served, Int8WeightOnlyConfig())
    assert matvec.ready(served) and all("_mm_matvec" in layer.__dict__ for layer in served)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_amx)])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_engine_uses_it_and_matches_stock_generate(fresh, family, dtype, monkeypatch):
    lm = fresh(family, dtype=getattr(torch, dtype))
    calls = counting(monkeypatch)
    pipe = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop(Sampler())})
    result = pipe.run(Request(prompt="Tell me about the sea.", max_new_tokens=12))
    assert calls[0] > 0  # the one-sequence decode steps ran it
    ids = torch.tensor([result.prompt_ids])
    count = calls[0]
    assert result.token_ids == generate_oracle(lm, ids, 12)  # generate() itself: PyTorch's kernels
    assert calls[0] == count


def test_matvec_false_keeps_pytorch_kernels(fresh, monkeypatch):
    lm = fresh("qwen3")
    calls = counting(monkeypatch)
    pipe = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop(Sampler(), matvec=False)})
    on = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop(Sampler())})
    request = Request(prompt="Count to five.", max_new_tokens=8)
    off_tokens = pipe.run(request).token_ids
    assert calls[0] == 0
    assert on.run(request).token_ids == off_tokens and calls[0] > 0


def test_failed_build_falls_back_in_one_line(monkeypatch, capsys):
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("Error building extension 'mm_pipeline_kernels'\nno compiler here")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(matvec, "_built", [])  # as in a fresh process
    with pytest.warns(matvec.NativeFallback):
        reason = matvec.load()
    assert reason == "RuntimeError: no compiler here"
    assert capsys.readouterr().err.count("\n") == 1
    assert matvec.load() == reason and capsys.readouterr().err == ""  # decided once
    assert not matvec.ready(torch.nn.Linear(64, 64))


def test_a_changed_header_or_source_is_a_new_build(tmp_path, monkeypatch):
    """torch's cache versions a build by its sources only: the shared header is in the name, so
    an edited header never loads the stale build; another copy (an installed package beside the
    source tree) has a build of its own instead of rebuilding over this one."""
    copies = {}
    for path in matvec.SOURCES + matvec.HEADERS:
        copies[path.name] = tmp_path / path.name
        copies[path.name].write_bytes(path.read_bytes())
    here = matvec.build_name()
    monkeypatch.setattr(matvec, "SOURCES", [copies[p.name] for p in matvec.SOURCES])
    monkeypatch.setattr(matvec, "HEADERS", [copies[p.name] for p in matvec.HEADERS])
    name = matvec.build_name()
    assert name != here and name == matvec.build_name()
    for path in copies.values():
        text = path.read_text()
        path.write_text(text + "// edited\n")
        assert matvec.build_name() != name, path.name
        path.write_text(text)


def test_many_bfloat16_rows_widen_to_float32_where_bfloat16_matmuls_are_slow(monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48).to(torch.bfloat16)
    matvec.attach(layer)
    x = torch.randn(2, matvec.MANY_ROWS, 64, dtype=torch.bfloat16)
    widened = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float()).to(torch.bfloat16)
    monkeypatch.setattr(matvec, "_native_bf16", lambda: False)
    with matvec.active():
        assert torch.equal(layer(x), widened)  # float32 accumulation, one rounding: the stock arithmetic
        few = x[0, :3]
        assert torch.equal(layer(few), torch.nn.functional.linear(few, layer.weight, layer.bias))  # below 8 rows: stock
    monkeypatch.setattr(matvec, "_native_bf16", lambda: True)  # oneDNN's bfloat16 kernels: not widened
    monkeypatch.setattr(matvec.packed, "usable", lambda x, weight: False)  # (their packed path: test_packed.py)
    with matvec.active():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_the_instruction_set_is_named_and_only_a_known_one_is_taken():
    assert matvec.isa() in ("avx2", "avx512")
    with pytest.raises(RuntimeError, match="avx2 or avx512, not neon"):
        matvec.isa("neon")
    assert matvec.isa() in _isas()  # unchanged by the refusal
