"""The fused RMSNorm, rotary and activation ops of the decode step (pipeline.runner.fused):
transformers' arithmetic bit for bit, taken only where ``attach`` proved it, the engine's tokens
the same with them as without, and a compiled step computing the eager step's bits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GemmaConfig
from transformers.activations import GELUTanh, SiLUActivation
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from conftest import ROOT, generate_oracle
from pipeline import Pipeline, Request, load_model
from pipeline.runner import fused, matvec
from stages import DecodeLoop, Prefill

pytestmark = pytest.mark.skipif(matvec.load() is not None, reason=f"native kernels unavailable: {matvec.load()}")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def no_verdicts(monkeypatch):
    """Every test starts with no module class checked."""
    monkeypatch.setattr(fused, "_verdicts", {})
    monkeypatch.setattr(fused, "_opaque", {})


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
    assert fused._verdicts == {(OffsetNorm, torch.float32): None}  # refused when attached
    x = torch.randn(1, 1, 256)
    with matvec.active():
        assert torch.equal(module(x), OffsetNorm.forward(module, x))


class DoubledSiLU(SiLUActivation):
    """Declared transformers' SiLU (inherited), computing something else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * torch.nn.functional.silu(x)


def test_declared_activations_are_taken_where_they_compute_pytorchs_own():
    ours, other = SiLUActivation(), DoubledSiLU()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16), ours, other)
    assert fused.attach(model) == 2
    assert fused._verdicts == {(SiLUActivation, torch.bfloat16): 0, (DoubledSiLU, torch.bfloat16): None}
    x = torch.randn(2, 64).to(torch.bfloat16)
    with matvec.active():
        assert torch.equal(ours(x), torch.nn.functional.silu(x)) and torch.equal(other(x), 2 * ours(x))


def test_an_activation_on_transformers_python_formula_keeps_it():
    """The verdict is its class's; an instance built on the Python formula computes other bits."""
    kernel, formula = GELUTanh(), GELUTanh(use_gelu_tanh_python=True)
    assert fused.attach(torch.nn.Sequential(torch.nn.Linear(4, 4), kernel, formula)) == 2
    x = torch.randn(2, 64)
    with matvec.active():
        assert torch.equal(formula(x), formula._gelu_tanh_python(x))
        assert torch.equal(kernel(x), torch.nn.functional.gelu(x, approximate="tanh"))


def test_a_norm_the_native_op_does_not_take_is_one_opaque_op_when_compiled():
    """Gemma's norm (one plus its weight, in float32) keeps its own code; compiled, Inductor would
    sum its reduction in its own order, so the graph calls that code as one op: the eager bits."""
    norm = GemmaRMSNorm(2048).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    assert fused.attach(torch.nn.Sequential(norm)) == 1
    targets = []

    def listing(gm: torch.fx.GraphModule, inputs: list) -> Any:
        targets.extend(node.target for node in gm.graph.nodes)
        return gm.forward

    x = (torch.randn(1, 1, 2048) * 3).to(torch.bfloat16)
    with matvec.active(), torch.inference_mode():
        torch._dynamo.reset()
        torch.compile(norm, backend=listing, fullgraph=True)(x)
        assert torch.ops.mm_pipeline.own_code.default in targets or torch.ops.mm_pipeline.own_code in targets
        torch._dynamo.reset()
        assert torch.equal(torch.compile(norm, fullgraph=True)(x), GemmaRMSNorm.forward(norm, x))
    torch._dynamo.reset()


class ConditionedLayerNorm(torch.nn.LayerNorm):
    """A norm by name taking a second input (adaptive norms of diffusion-style blocks)."""

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + shift


def test_a_norm_by_name_taking_other_inputs_keeps_its_own_code():
    module = ConditionedLayerNorm(64)
    assert fused.attach(torch.nn.Sequential(module)) == 1  # attaching does not fail on it
    assert fused._opaque[(ConditionedLayerNorm, torch.float32)] is False
    x, shift = torch.randn(2, 64), torch.randn(2, 64)
    with matvec.active():
        assert torch.equal(module(x, shift), torch.nn.LayerNorm.forward(module, x) + shift)


def test_outside_the_engines_steps_a_module_runs_its_own_code(monkeypatch):
    module = norm(256, torch.float32)
    fused.attach(torch.nn.Sequential(module))
    assert fused._verdicts[(LlamaRMSNorm, torch.float32)] in fused.LANES
    monkeypatch.setattr(torch.ops.mm_pipeline, "rms_norm", lambda *a: pytest.fail("the native op was reached"))
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
    return saved(config, source, tmp_path_factory.mktemp("qwen3-native"))


def saved(config: Any, source: Path, out: Path) -> Path:
    """A model of ``config`` with seeded random weights, saved as a user's checkpoint with the
    tokenizer of the tiny model at ``source``."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for path in source.iterdir():
        if path.name.startswith("tokenizer") or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    return out


@pytest.fixture(scope="module")
def gemma_dir(tiny_dir, tmp_path_factory) -> Path:
    """A held-out Gemma (``save_pretrained``): norms of one plus their weight (its own code), tanh
    GELU, the embedding scaled by the hidden size's root, the tiny Qwen3's tokenizer."""
    source = tiny_dir("qwen3")
    vocab = AutoConfig.from_pretrained(source).vocab_size
    config = GemmaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, hidden_activation="gelu_pytorch_tanh",
    )  # fmt: skip
    return saved(config, source, tmp_path_factory.mktemp("gemma-native"))


@pytest.mark.parametrize("dtype, quant", [("float32", "auto"), ("bfloat16", "none")])
def test_engine_tokens_are_the_same_with_the_fused_ops(qwen3_dir, dtype, quant, monkeypatch):
    lm = load_model(str(qwen3_dir), dtype=dtype, quant=quant)
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()})
    ids, n = list(range(30, 50)), 24
    fused_tokens = pipe.run_ids(ids, Request(max_new_tokens=n, ignore_eos=True)).generated
    kinds = {cls.__name__: verdict for (cls, _), verdict in fused._verdicts.items()}
    assert kinds.pop("Qwen3RMSNorm") in fused.LANES and kinds.pop("SiLUActivation") == 0, kinds
    assert list(kinds.values()) == [0], kinds  # the rotation, checked and taken (None: refused)
    monkeypatch.setattr(fused, "_active", lambda x: False)
    pipe.pool.clear_prefix_cache()
    assert pipe.run_ids(ids, Request(max_new_tokens=n, ignore_eos=True)).generated == fused_tokens
    if dtype == "float32":
        assert fused_tokens == generate_oracle(lm, torch.tensor([ids]), n, ignore_eos=True)


COMPILED_SCRIPT = """
import json, sys, torch
from pipeline import Pipeline, Request, load_model
from pipeline.runner import compiled
from stages import DecodeLoop, Prefill
lm = load_model(sys.argv[1], dtype="bfloat16", quant="auto")  # int8 weights: the CPU default
same = []
build = compiled.CompiledStep._compile
def _compile(self, fn, lm):  # each compiled step checked against the eager step on its inputs
    step = build(self, fn, lm)
    def checked(model, pool, *inputs):
        out = step(model, pool, *inputs)
        same.append(torch.equal(out[3], fn(model, pool, *inputs)[3]))
        return out
    return checked
compiled.CompiledStep._compile = _compile
ids = list(range(30, 50))
runs = {}
for on in (False, True):
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(compile=on)})
    pipe.pool.clear_prefix_cache()  # each run prefills its prompts itself
    runs[on] = [pipe.run_ids(ids[k:], Request(max_new_tokens=24, ignore_eos=True)).generated for k in (0, 3, 7)]
print(json.dumps({"same": same, "tokens": runs[True] == runs[False]}))
"""


# Qwen3's case (native norms, SiLU) is slow (32 s on 2 cores); Gemma's covers the native rotation and
# activation and the opaque call of a norm's own code, and test_auto_compile compiles native norms
@pytest.mark.parametrize("model", [pytest.param("qwen3_dir", marks=pytest.mark.slow), "gemma_dir"])
def test_a_compiled_step_computes_the_eager_steps_bits(model, request, tmp_path):
    """bfloat16, int8 weights (the CPU default): Inductor's own code for the norms, rotations,
    activation and small int8 layers rounds otherwise (most logits of a step differed before the
    compiled graph took them as opaque ops), so ``decode.compile=auto`` switching mid-request
    would change tokens; a norm they do not take (Gemma's) is one opaque call of its own code.
    Held-out models whose attention projections are below the kernel's size floor; Inductor in
    a process and cache of its own (test_compiled.py says why)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILED_SCRIPT, str(request.getfixturevalue(model))],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got["same"]) == 3 * 23 and all(got["same"]) and got["tokens"], got  # every step compiled
