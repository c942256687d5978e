"""``model.dtype=auto`` follows the checkpoint where that computes fast (issue 52): a bfloat16
checkpoint computes in bfloat16 on a CPU with bfloat16 instructions, float32 elsewhere; a float32
checkpoint stays float32. Held-out checkpoints here (``save_pretrained``, no project marker), so
``quant=auto`` loads them as a user's: int8wo on a CPU with the native kernel."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import generate_oracle
from pipeline import Pipeline, Request, load_model
from pipeline.model import loading
from stages import DecodeLoop, Prefill


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_dir, tmp_path_factory) -> Path:
    """The tiny Llama's weights saved in bfloat16 as a user's checkpoint (config.json: "dtype")."""
    source = tiny_dir("llama")
    out = tmp_path_factory.mktemp("bf16-checkpoint")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(out)
    for path in source.iterdir():
        if path.name.startswith("tokenizer") or path.suffix == ".jinja" or path.name == "generation_config.json":
            shutil.copy(path, out / path.name)
    return out


@pytest.mark.parametrize("instructions", [True, False])
def test_a_bfloat16_checkpoint_computes_in_bfloat16_where_the_cpu_has_it(bf16_checkpoint, monkeypatch, instructions):
    monkeypatch.setattr(loading, "cpu_has_bf16", lambda: instructions)
    lm = load_model(str(bf16_checkpoint), quant="auto")
    expected = torch.bfloat16 if instructions else torch.float32
    assert lm.model.dtype == expected
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=1 << 20)
    assert pipe.pool.dtype == expected  # the KV cache follows the model
    ids = lm.tokenizer("The sea and the sky meet where the light falls")["input_ids"]
    ctx = pipe.run_ids(ids, Request(max_new_tokens=12, ignore_eos=True))
    assert ctx.generated == generate_oracle(lm, torch.tensor([ids]), 12, ignore_eos=True)


def test_a_float32_checkpoint_stays_float32_and_an_explicit_dtype_wins(tiny_dir, monkeypatch):
    monkeypatch.setattr(loading, "cpu_has_bf16", lambda: True)
    assert load_model(str(tiny_dir("llama"))).model.dtype == torch.float32
    assert load_model(str(tiny_dir("llama")), dtype="bfloat16").model.dtype == torch.bfloat16
