"""The fused RMSNorm and rotary ops of the eager decode step (pipeline.runner.fused): transformers'
arithmetic bit for bit, taken only where a module's first call proved it, and the engine's tokens
the same with them as without."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from conftest import generate_oracle
from pipeline import Pipeline, Request, load_model
from pipeline.runner import fused, matvec
from stages import DecodeLoop, Prefill

pytestmark = pytest.mark.skipif(matvec.load() is not None, reason=f"native kernels unavailable: {matvec.load()}")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def no_verdicts(monkeypatch):
    """Every test starts with no module class checked."""
    monkeypatch.setattr(fused, "_verdicts", {})


def norm(hidden: int, dtype: torch.dtype, cls: type = LlamaRMSNorm) -> torch.nn.Module:
    module = cls(hidden, eps=1e-5).to(dtype)
    module.weight.data = torch.randn(hidden).to(dtype)
    return module


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_transformers_bit_for_bit(dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, 1, 1280) * 3).to(dtype)
    module = norm(1280, dtype)
    # ATen sums floats in vectors of 8 or 16 lanes (its build): one of them is this one
    lanes = [
        n for n in fused.LANES if torch.equal(torch.ops.mm_pipeline.rms_norm(x, module.weight, 1e-5, n), module(x))
    ]
    assert len(lanes) >= 1
    for hidden in (8, 64, 100, 896, 3584, 4096, 5120):  # short rows, a tail past the vectors, many levels
        module = norm(hidden, dtype)
        for rows in (1, 3):
            x = (torch.randn(1, rows, hidden) * 3).to(dtype)
            got = torch.ops.mm_pipeline.rms_norm(x, module.weight, module.variance_epsilon, lanes[0])
            assert torch.equal(got, module(x)), (hidden, rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_rotary_is_transformers_bit_for_bit_in_the_layout_attention_makes(dtype, tokens):
    torch.manual_seed(0)
    q = torch.randn(1, tokens, 6, 64).to(dtype).transpose(1, 2)  # [1, heads, tokens, dim] as a view
    k = torch.randn(1, tokens, 2, 64).to(dtype).transpose(1, 2)
    cos, sin = (torch.randn(1, tokens, 64).to(dtype) for _ in range(2))
    want = apply_rotary_pos_emb(q, k, cos, sin)
    got = torch.ops.mm_pipeline.rotary(q, k, cos, sin)
    for a, b in zip(got, want):
        assert torch.equal(a, b) and layout(a) == layout(b)


def layout(t: torch.Tensor) -> list[int]:
    """The strides that matter: those of dimensions longer than one."""
    return [stride for stride, size in zip(t.stride(), t.shape) if size > 1]


class OffsetNorm(LlamaRMSNorm):
    """Declared a standard RMSNorm (inherited), computing Gemma's ``1 + weight`` instead."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1.0 + self.weight.float()) * h.to(x.dtype)


def test_a_declared_norm_with_other_arithmetic_keeps_its_own_code():
    module = norm(256, torch.float32, OffsetNorm)
    assert fused.attach(torch.nn.Sequential(module)) == 1
    x = torch.randn(1, 1, 256)
    with matvec.active():
        first, second = module(x), module(x)
    assert fused._verdicts == {(OffsetNorm, torch.float32): False}
    assert torch.equal(first, OffsetNorm.forward(module, x)) and torch.equal(second, first)


def test_outside_the_engines_steps_a_module_runs_its_own_code(monkeypatch):
    module = norm(256, torch.float32)
    fused.attach(torch.nn.Sequential(module))
    monkeypatch.setattr(fused, "_checked", lambda *a, **k: pytest.fail("the native op was reached"))
    module(torch.randn(1, 1, 256))  # not inside matvec.active(): generate() and the like
    with matvec.active():
        module(torch.randn(1, 600, 256))  # a prefill's many rows: PyTorch's parallel kernels


@pytest.fixture(scope="module")
def qwen3_dir(tiny_dir, tmp_path_factory) -> Path:
    """A held-out Qwen3 (``save_pretrained``): linear layers the native kernels take (256 x 512),
    RMSNorms on the hidden state and on each head's queries and keys, 64-dim heads, 4 on 2."""
    source = tiny_dir("qwen3")
    config = AutoConfig.from_pretrained(source)
    config.update(dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2))
    config.head_dim = 64
    out = tmp_path_factory.mktemp("qwen3-native")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for path in source.iterdir():
        if path.name.startswith("tokenizer") or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    return out


@pytest.mark.parametrize("dtype, quant", [("float32", "auto"), ("bfloat16", "none")])
def test_engine_tokens_are_the_same_with_the_fused_ops(qwen3_dir, dtype, quant, monkeypatch):
    lm = load_model(str(qwen3_dir), dtype=dtype, quant=quant)
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()})
    ids, n = list(range(30, 50)), 24
    fused_tokens = pipe.run_ids(ids, Request(max_new_tokens=n, ignore_eos=True)).generated
    kinds = {cls.__name__: verdict for (cls, _), verdict in fused._verdicts.items()}
    assert isinstance(kinds.get("Qwen3RMSNorm"), int) and kinds["Qwen3RMSNorm"] in fused.LANES, kinds
    rotation = [v for k, v in kinds.items() if k != "Qwen3RMSNorm"]
    assert [type(v) for v in rotation] == [int] and rotation == [0], kinds  # checked and taken (False: refused)
    monkeypatch.setattr(fused, "_active", lambda x: False)
    pipe.pool.clear_prefix_cache()
    assert pipe.run_ids(ids, Request(max_new_tokens=n, ignore_eos=True)).generated == fused_tokens
    if dtype == "float32":
        assert fused_tokens == generate_oracle(lm, torch.tensor([ids]), n, ignore_eos=True)
