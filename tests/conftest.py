"""Tiny models of each family, built once per session and loaded through the real loading code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The suite runs on two workers (pyproject's addopts): one thread each, their subprocesses too
    # (they inherit it). Two OpenMP teams of two threads spinning on two cores made the parallel
    # suite slower than the serial one. Kernel tests that split work between threads set their own.
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after the thread setting: OpenMP reads it when torch loads)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(family) -> a save_pretrained directory with random weights and a made tokenizer."""
    from pipeline.testing import build_tiny

    built: dict[str, Path] = {}
    base = tmp_path_factory.mktemp("tiny")

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny(family, base / family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def held_out_dir(tiny_dir, tmp_path_factory):
    """held_out_dir(family) -> a copy of the tiny model without the project's marker: it reads as a
    checkpoint a user brings, so ``quant=auto`` picks what it picks for a real model (int8wo on CPU)."""
    import shutil

    from pipeline.tiny import MARKER_FILE

    copies: dict[str, Path] = {}
    base = tmp_path_factory.mktemp("held_out")

    def get(family: str) -> Path:
        if family not in copies:
            copies[family] = Path(shutil.copytree(tiny_dir(family), base / family))
            (copies[family] / MARKER_FILE).unlink()
        return copies[family]

    return get


@pytest.fixture(scope="session")
def qwen3_server(tiny_dir, tmp_path_factory):
    """One ``mode=serve`` on the tiny Qwen3 (float32, served as "qwen3", default settings) for every
    test file on this worker that needs no other settings: a server start costs about 14 s. Files
    that share it must not depend on its counters or its prefix cache being fresh."""
    from serving import serving_tiny

    with serving_tiny(tmp_path_factory.mktemp("serve-qwen3"), tiny_dir("qwen3"), "qwen3") as server:
        yield server


@pytest.fixture(scope="session")
def load_tiny(tiny_dir):
    """load_tiny(family, **load_model_kwargs) -> LoadedModel, cached per (family, kwargs).

    float32 unless ``dtype`` says otherwise, whatever the device: ``dtype=auto`` would load
    bfloat16 on a GPU, where the exact-match tests would see argmaxes flip."""
    from pipeline import load_model

    loaded: dict = {}

    def get(family: str, **kwargs):
        kwargs.setdefault("dtype", torch.float32)
        key = (family, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in loaded:
            loaded[key] = load_model(str(tiny_dir(family)), **kwargs)
        return loaded[key]

    get.loaded = loaded
    return get


@pytest.fixture(autouse=True)
def fresh_prefix_cache(load_tiny):
    """Each test starts as a new process would: no prefix-cache blocks left by earlier tests
    (blocks still held by live caches stay), so its ``kv_reused_tokens`` are its own."""
    clear_prefix_caches(load_tiny.loaded.values())


def clear_prefix_caches(models) -> None:
    """Drop the prefix-cache blocks of these models' shared pools (blocks live caches hold stay)."""
    from pipeline.kv import BlockPool

    for lm in models:
        for obj in lm.__dict__.get("_mm_shared", {}).values():
            if isinstance(obj, BlockPool):
                obj.clear_prefix_cache()


@pytest.fixture
def split_threads():
    """Three intra-op threads for the test (whatever the worker runs with): the native kernels
    split rows and heads between threads, and an uneven split is where a partition goes wrong."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


def on_device(lm, **tensors) -> dict:
    """``tensors`` (processor outputs, ids built on the host) on the model's device: a GPU model
    refuses CPU inputs. Other values pass through."""
    return {k: v.to(lm.device) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}


def generate_oracle(lm, input_ids: torch.Tensor, max_new_tokens: int, ignore_eos: bool = False, **inputs) -> list[int]:
    """transformers' own greedy generate on the same model and inputs (moved to its device):
    the correctness oracle."""
    input_ids = input_ids.to(lm.device)
    inputs = on_device(lm, **inputs)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=lm.tokenizer.pad_token_id or 0,
    )
    if ignore_eos:  # EOS is kept and generation goes on, as the pipeline does (not masked out)
        kwargs.update(eos_token_id=None)
    with torch.inference_mode():
        out = lm.model.generate(**kwargs, **inputs)
    return out[0, input_ids.shape[1] :].tolist()


def image_chat_inputs(lm, images: list, text: str) -> tuple[torch.Tensor, dict]:
    """(input ids, the other model inputs) the model's own processor makes of one user message
    with these images then ``text``: what generate() is given as the oracle's input."""
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    inputs = dict(
        lm.processor.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
    )
    inputs.pop("attention_mask")
    return inputs.pop("input_ids"), inputs


def logprob_oracle(lm, ids: list[int], **inputs) -> torch.Tensor:
    """log_softmax of a plain transformers forward over ``ids`` (float32, on the CPU): row p is
    the distribution of the token after position p. The log-probability oracle."""
    input_ids = torch.tensor([ids], device=lm.device)
    with torch.inference_mode():
        logits = lm.model(input_ids=input_ids, **on_device(lm, **inputs)).logits[0]
    return logits.float().log_softmax(-1).cpu()


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, input: str | None = None, timeout: int = 300):
    """python -m pipeline in a subprocess (the end-to-end contract)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        input=input,
        timeout=timeout,
    )


def kernel_calls(run, op: str = "mm_pipeline::decode_attention") -> tuple[object, int]:
    """``run()``'s result and how many times ``op`` ran inside it (any thread: the engine's too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], acc_events=True) as prof:
        out = run()
    return out, sum(e.count for e in prof.key_averages() if e.key == op)


def submit_all(pipe, prompts: list[list[int]], n: int, **request) -> list:
    """Every prompt submitted at once (one engine batch), ``n`` tokens each (greedy unless
    ``request`` says otherwise), EOS ignored; their contexts."""
    from pipeline import Request

    handles = [pipe.submit(Request(max_new_tokens=n, ignore_eos=True, **request), ids=p, result=False) for p in prompts]
    return [pipe.wait(h) for h in handles]
