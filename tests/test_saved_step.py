"""The compiled decode step saved whole on CPU (``pipeline.runner.saved_step``): what names its
file, what it keeps of Dynamo's guards, and what happens to a file that no longer loads. That a
second process loads it, with the same tokens, is checked end to end by the command line's
three runs in ``test_auto_compile.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.runner import saved_step


class Pool:
    """What ``structure`` reads of a pool: its key and value tensors."""

    def __init__(self, *shape: int) -> None:
        self.tensors = [torch.zeros(shape), torch.zeros(shape)]

    def kv_tensors(self) -> list[torch.Tensor]:
        return self.tensors


def llama(**config) -> LlamaForCausalLM:
    torch.manual_seed(0)
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    return LlamaForCausalLM(LlamaConfig(**{**base, **config})).eval()


def test_a_model_of_another_shape_dtype_or_pool_is_named_apart():
    pool = Pool(8, 4, 2, 8)
    same = saved_step.structure(llama(), pool)
    assert saved_step.structure(llama(), Pool(8, 4, 2, 8)) == same  # other weights, the same shapes: one step
    assert saved_step.structure(llama(intermediate_size=96), pool) != same
    half = llama()
    half.model.layers[1].mlp.to(torch.bfloat16)
    assert saved_step.structure(half, pool) != same
    assert saved_step.structure(llama(), Pool(16, 4, 2, 8)) != same


def test_a_cpu_whose_kernels_are_built_for_other_instruction_sets_gets_another_name(monkeypatch, request):
    """torch calls an AMX Xeon and an AVX-512 CPU without bfloat16 both "AVX512", but Inductor
    builds the first one's kernels with ``-mavx512bf16 -mamx-bf16``: through a shared cache folder
    the second must not load them."""
    from torch._inductor import cpu_vec_isa

    request.addfinalizer(saved_step._vec_isa.cache_clear)  # (the real CPU's, read again after)

    def name() -> str:
        saved_step._vec_isa.cache_clear()
        return saved_step._name("key", "one", llama(), Pool(8, 4, 2, 8))

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", cpu_vec_isa.VecAVX512)
    plain = name()
    assert name() == plain
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", cpu_vec_isa.VecAMX)
    assert name() != plain


def test_only_the_steps_own_tensors_and_global_state_keep_their_guards():
    entries = [
        SimpleNamespace(guard_type="TENSOR_MATCH", name="ids"),
        SimpleNamespace(guard_type="TENSOR_MATCH", name="L['model'].layers[0].mlp.weight"),
        SimpleNamespace(guard_type="TYPE_MATCH", name="L['model']"),
        SimpleNamespace(guard_type="GLOBAL_STATE", name=""),
        SimpleNamespace(guard_type="SHAPE_ENV", name=""),
        SimpleNamespace(guard_type="TENSOR_MATCH", name="G['_NO_MASK']"),
    ]
    assert saved_step._own_guards(entries) == [True, False, False, True, True, False]


def test_a_saved_step_that_no_longer_loads_is_removed_so_that_it_is_compiled_anew(tmp_path):
    path = tmp_path / "step.step"
    path.write_bytes(b"cut short")
    assert saved_step._load(path) is None
    assert not path.exists()
    assert saved_step._load(tmp_path / "none.step") is None


def breaks(model: torch.nn.Module, pool: Pool, *inputs: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()  # no whole graph: aot_compile refuses at once, before Inductor
    return model(inputs[0])


def test_a_step_that_cannot_be_saved_is_noted_so_that_later_processes_trace_it_once(monkeypatch, tmp_path):
    model, pool = torch.nn.Linear(4, 4), Pool(8, 4)
    inputs = (torch.zeros(1, 4), torch.zeros(1), torch.ones(1), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(saved_step.GuardMismatch):  # the caller then compiles with torch.compile
        saved_step.SavedStep(breaks, {}, lambda pool: "key", tmp_path)(model, pool, *inputs)
    (note,) = (tmp_path / saved_step.FOLDER).glob("*.unsaved")
    assert "graph_break" in note.read_text() or "Unsupported" in note.read_text()
    traced = []
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: traced.append(args))
    with pytest.raises(saved_step.GuardMismatch):
        saved_step.SavedStep(breaks, {}, lambda pool: "key", tmp_path)(model, pool, *inputs)
    assert traced == []
