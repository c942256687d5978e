"""Stages that compose: a user's Prefill, DecodeLoop or Sampler subclass is called by the engine,
batched with ordinary requests that stay exact; a stage the engine cannot honour is refused."""

from __future__ import annotations

import json

import pytest
import torch

from hydra import compose, initialize_config_dir

from conftest import run_cli
from helpers import CallPrefill, EvenTokenSampler, StopAfterTwo, ThreeTokenChunks
from pipeline import Pipeline, Request, UserError
from pipeline.__main__ import CONF_DIR
from pipeline.cli.assemble import stages_from_cfg
from stages import DecodeLoop, Prefill, Sampler, Tokenize, VisionEncoder

N = 8
PROMPTS = ["The sea is", "Tell me about mountains and rivers.", "One two three four", "Why?"]


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("qwen3")


def pipe_with(lm, prefill=None, decode=None, **engine) -> Pipeline:
    stages = {"tokenize": Tokenize(), "prefill": prefill or Prefill(), "decode": decode or DecodeLoop()}
    return Pipeline(lm, stages, **engine)


def solo(lm, prompt: str, **request) -> list[int]:
    return pipe_with(lm).run(Request(prompt=prompt, max_new_tokens=N, ignore_eos=True, **request)).token_ids


def run_together(pipe: Pipeline, requests: list[Request]) -> list:
    return [h.result() for h in [pipe.submit(r) for r in requests]]


class BanToken(DecodeLoop):
    """``process_logits``: bans one token; records the row counts of its calls (one per step)."""

    def __init__(self, banned: int) -> None:
        super().__init__()
        self.banned = banned
        self.calls: list[int] = []

    def process_logits(self, logits: torch.Tensor, contexts: list) -> torch.Tensor:
        self.calls.append(logits.shape[0])
        logits[:, self.banned] = float("-inf")
        return logits


def test_process_logits_runs_once_per_step_on_its_rows_and_others_stay_exact(lm):
    plain = [solo(lm, p) for p in PROMPTS]
    banned = plain[0][0]  # the first request's own first choice
    hooked = BanToken(banned)
    pipe = pipe_with(lm)
    mine = pipe.with_stages({**pipe.stages, "decode": hooked})
    handles = [mine.submit(Request(prompt=p, max_new_tokens=N, ignore_eos=True)) for p in PROMPTS[:2]]
    handles += [pipe.submit(Request(prompt=p, max_new_tokens=N, ignore_eos=True)) for p in PROMPTS[2:]]
    results = [h.result() for h in handles]
    assert all(banned not in r.token_ids for r in results[:2])
    assert results[0].token_ids != plain[0]
    assert [r.token_ids for r in results[2:]] == plain[2:]  # rows without the hook untouched
    assert max(hooked.calls) == 2  # both hooked rows in one call per step


def test_on_token_stops_the_sequence(lm):
    pipe = pipe_with(lm, decode=StopAfterTwo())
    result = pipe.run(Request(prompt=PROMPTS[1], max_new_tokens=N, ignore_eos=True))
    assert len(result.token_ids) == 2 and result.finish_reason == "stop"
    assert result.token_ids == solo(lm, PROMPTS[1])[:2]


def test_plan_chunk_decides_the_prefill_chunks(lm):
    prefill = ThreeTokenChunks()
    pipe = pipe_with(lm, prefill=prefill)
    result = pipe.run(Request(prompt=PROMPTS[1], max_new_tokens=N, ignore_eos=True))
    starts = [start for start, _ in prefill.asked]
    assert starts[:3] == [0, 3, 6] and all(b - a == 3 for a, b in zip(starts, starts[1:]))
    assert result.token_ids == solo(lm, PROMPTS[1])


def test_a_sampler_subclass_under_greedy_settings_is_called_batched_with_plain_rows(lm):
    plain = [solo(lm, p) for p in PROMPTS]
    assert any(t % 2 for t in plain[0]), "the test needs an odd token in the plain answer"
    pipe = pipe_with(lm)
    requests = [Request(prompt=PROMPTS[0], max_new_tokens=N, ignore_eos=True, sampler=EvenTokenSampler())]
    requests += [Request(prompt=p, max_new_tokens=N, ignore_eos=True) for p in PROMPTS[1:]]
    results = run_together(pipe, requests)
    assert all(t % 2 == 0 for t in results[0].token_ids)
    assert [r.token_ids for r in results[1:]] == plain[1:]


def test_the_builtin_greedy_sampler_is_argmax_only_and_a_subclass_is_not():
    assert Sampler().argmax_only
    assert not Sampler(repetition_penalty=1.2).argmax_only
    assert not Sampler(temperature=0.7).argmax_only
    assert not EvenTokenSampler().argmax_only


@pytest.mark.parametrize(
    "stage, message",
    [
        ({"prefill": CallPrefill()}, "CallPrefill overrides __call__"),
        ({"prefill": lambda ctx: ctx}, "is not a stages.Prefill"),
        (
            {"decode": type("CallDecode", (DecodeLoop,), {"__call__": lambda self, ctx: ctx})()},
            "CallDecode overrides __call__",
        ),
    ],
)
def test_a_phase_the_engine_cannot_honour_is_refused(lm, stage, message):
    with pytest.raises(UserError, match=message):
        Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop(), **stage})


def test_an_image_with_no_vision_encoder_is_refused(load_tiny, tmp_path):
    from PIL import Image

    lm = load_tiny("qwen2-vl")
    pipe = pipe_with(lm)
    image = Image.new("RGB", (56, 56), "red")
    with pytest.raises(UserError, match="no stage encodes a image"):
        pipe.run(Request(prompt="What is it?", images=[image], max_new_tokens=2))
    with_encoder = Pipeline(
        lm, {"tokenize": Tokenize(), "vision_encoder": VisionEncoder(), "prefill": Prefill(), "decode": DecodeLoop()}
    )
    assert len(with_encoder.run(Request(prompt="What is it?", images=[image], max_new_tokens=2)).token_ids) >= 1


def test_hooks_swapped_in_by_hydra_overrides(tiny_dir, tmp_path):
    proc = run_cli(
        f"model.path={tiny_dir('qwen3')}",
        "prompt=Hi there",
        "max_new_tokens=6",
        "ignore_eos=true",
        "stages.decode._target_=tests.helpers.StopAfterTwo",
        "sampler._target_=tests.helpers.EvenTokenSampler",
        "stages.prefill._target_=tests.helpers.ThreeTokenChunks",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(result["token_ids"]) == 2 and all(t % 2 == 0 for t in result["token_ids"])
    assert result["finish_reason"] == "stop"


def test_a_phase_override_is_refused_when_the_stages_are_built_before_the_model_loads():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["stages.prefill._target_=tests.helpers.CallPrefill"])
    with pytest.raises(UserError, match="stages.prefill: CallPrefill overrides __call__"):
        stages_from_cfg(cfg)  # every mode builds its stages before it loads the model


def test_an_image_without_a_vision_encoder_is_one_line_before_the_model_loads(tmp_path):
    proc = run_cli("stages.vision_encoder=null", "max_new_tokens=2", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: the request has images but no stage encodes a image")
    assert "Traceback" not in proc.stderr and "Loading weights" not in proc.stderr


def test_a_removed_keyword_says_what_to_use(lm):
    with pytest.raises(TypeError, match=r"Pipeline\(kv_max_len=...\) was removed in 0.2: .*kv_memory="):
        Pipeline(lm, {"tokenize": Tokenize()}, kv_max_len=512)
    with pytest.raises(TypeError, match="unexpected keyword argument 'kv_memroy'"):
        Pipeline(lm, {"tokenize": Tokenize()}, kv_memroy=1 << 20)
