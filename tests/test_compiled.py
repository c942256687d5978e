"""The compiled decode step (``decode.compile=true``), warm-up and chunked prefill give exactly the
tokens of the eager engine and of ``generate(do_sample=False)``, alone and in batches.

Compiling with inductor costs tens of seconds on a small CPU, so most compiled tests use the
``aot_eager`` backend: the same graph capture (dynamo over the model and the paged attention),
no code generation. One test compiles with inductor.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image

from conftest import ROOT, generate_oracle
from pipeline import Pipeline, Request, UserError
from pipeline.cli.assemble import engine_settings, kv_memory, max_seqs, stages_from_cfg
from stages import DecodeLoop, Prefill, Tokenize
from stages.decode import FastPathFallback

N = 12


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("qwen3")


@pytest.fixture(scope="module")
def prompt(lm) -> list[int]:
    return lm.tokenizer("The quick brown fox jumps over the lazy dog, again and again.")["input_ids"]


def run_ids(pipe: Pipeline, ids: list[int], n: int = N, **request):
    """Prefill + decode from raw ids (no template) through the engine."""
    return pipe.run_ids(ids, Request(max_new_tokens=n, **{"ignore_eos": True, **request}))


POOL = 1 << 20  # small: aot_eager copies a mutated input (the pool) whole on every step


def pipe_of(lm, chunk: int | None = None, **decode) -> Pipeline:
    return Pipeline(lm, {"prefill": Prefill(chunk), "decode": DecodeLoop(**decode)}, kv_memory=POOL)


def oracle(lm, ids: list[int], n: int = N) -> list[int]:
    return generate_oracle(lm, torch.tensor([ids], device=lm.device), n, ignore_eos=True)


def fallbacks(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, FastPathFallback)]


def run_twice(pipe: Pipeline, ids: list[int]):
    """Two runs of the same prompt and the fallback warnings they raised (one is allowed, once)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        a = run_ids(pipe, ids)
        b = run_ids(pipe, ids)
    return a, b, fallbacks(record)


# --- compiled step ----------------------------------------------------------------------------


def test_compiled_step_equals_eager_and_generate(lm, prompt):
    pipe = pipe_of(lm, compile=True, compile_backend="aot_eager")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = run_ids(pipe, prompt)
        second = run_ids(pipe, prompt[:-3])
    assert fallbacks(record) == []
    assert first.metrics.to_dict()["decode_compiled"] is True
    assert first.generated == run_ids(pipe_of(lm), prompt).generated == oracle(lm, prompt)
    assert second.generated == oracle(lm, prompt[:-3])
    assert first.cache.length == len(prompt) + N - 1 and first.cache.keys == prompt + first.generated[:-1]


def test_compiled_batches_equal_their_solo_runs(lm, prompt):
    pipe = pipe_of(lm, compile=True, compile_backend="aot_eager")
    prompts = [prompt[: 6 + 3 * i] for i in range(5)]
    handles = [
        pipe.submit(Request(max_new_tokens=N - i, ignore_eos=True), ids=p, result=False) for i, p in enumerate(prompts)
    ]
    for i, (p, h) in enumerate(zip(prompts, handles)):
        assert pipe.wait(h).generated == oracle(lm, p, N - i)


def test_sampled_rows_on_the_compiled_step_equal_eager(lm, prompt):
    """Sampled rows take the compiled step's logits (not its argmax): seeded, the same tokens as
    eager decoding, and they did run compiled."""
    from pipeline.runner.compiled import CompiledStep
    from stages import Sampler

    def sampled(**decode) -> list[int]:
        pipe = pipe_of(lm, sampler=Sampler(temperature=0.8, seed=5), **decode)
        return run_ids(pipe, prompt).generated

    calls = []
    with pytest.MonkeyPatch.context() as mp:
        real = CompiledStep.__call__
        mp.setattr(CompiledStep, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
        assert sampled(compile=True, compile_backend="aot_eager") == sampled()
    assert len(calls) >= N - 1


def test_eos_and_stop_strings_on_the_compiled_path(lm, prompt):
    free = run_ids(pipe_of(lm), prompt, n=24)
    eos = free.generated[6]
    j = free.generated.index(eos)
    pipe = pipe_of(lm, compile=True, compile_backend="aot_eager")
    saved = lm.model.generation_config.eos_token_id
    lm.model.generation_config.eos_token_id = eos
    try:
        fast = run_ids(pipe, prompt, n=24, ignore_eos=False)
    finally:
        lm.model.generation_config.eos_token_id = saved
    assert fast.generated == free.generated[: j + 1] and fast.finish_reason == "eos"
    assert fast.cache.length == len(prompt) + j
    stop = free.text[4:7]
    pieces: list[str] = []
    cut = pipe.run_ids(prompt, Request(max_new_tokens=24, ignore_eos=True, stop=[stop]), on_text=pieces.append)
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.find(stop)]
    assert "".join(pieces) == cut.text


INDUCTOR_SCRIPT = """
import sys, warnings, torch
from pipeline import Pipeline, Request, load_model
from stages import DecodeLoop, Prefill
from stages.decode import FastPathFallback
warnings.simplefilter("error", FastPathFallback)
lm = load_model(sys.argv[1], dtype=torch.float32)
ids = lm.tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"][:8]
pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(compile=True)}, kv_memory=1 << 20)
pipe.warmup()
asks = ((4, 8), (6, 5))
handles = [pipe.submit(Request(max_new_tokens=n, ignore_eos=True), ids=ids[:k], result=False) for n, k in asks]
got = [pipe.wait(h) for h in handles]
assert all(c.metrics.info["decode_compiled"] for c in got)
for c, k in zip(got, (8, 5)):
    ref = lm.model.generate(input_ids=torch.tensor([ids[:k]], device=lm.device),
                            attention_mask=torch.ones(1, k, dtype=torch.long, device=lm.device),
                            do_sample=False, max_new_tokens=len(c.generated), eos_token_id=None, pad_token_id=0)
    assert c.generated == ref[0, k:].tolist(), (c.generated, ref)
print("ok")
"""


@pytest.mark.slow  # 72 s; inductor's CPU code generation also runs in test_flex's compiled kernel test
def test_inductor_compiled_step(tiny_dir):
    """The real code generation once (CPU inductor), a batch of two then of one. In its own
    process: dynamo has crashed here when one process compiled the same function with aot_eager
    on one thread and then with inductor on another (torch 2.11), which users never do."""
    proc = subprocess.run(
        [sys.executable, "-c", INDUCTOR_SCRIPT, str(tiny_dir("qwen3"))],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_compile_error_falls_back_with_one_warning(lm, prompt):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("this backend cannot compile anything")

    pipe = pipe_of(lm, compile=True, compile_backend=broken_backend)
    a, b, messages = run_twice(pipe, prompt)
    assert len(messages) == 1 and "torch.compile failed" in messages[0]
    assert a.generated == b.generated == oracle(lm, prompt)
    assert a.cache.length == len(prompt) + N - 1
    assert a.metrics.to_dict()["decode_compiled"] is False


def test_nf4_falls_back_with_one_warning(load_tiny, prompt):
    lm4 = load_tiny("qwen3", quant="nf4")
    assert lm4.quant == "nf4"
    pipe = pipe_of(lm4, compile=True)
    a, b, messages = run_twice(pipe, prompt)
    assert len(messages) == 1 and "nf4" in messages[0]
    assert a.generated == b.generated == run_ids(pipe_of(lm4), prompt).generated == oracle(lm4, prompt)


# --- warm-up ----------------------------------------------------------------------------------


def test_warmup_is_reported_apart_and_requests_compile_nothing(lm, prompt):
    from torch._dynamo.utils import counters

    pipe = pipe_of(lm, compile=True, compile_backend="aot_eager")
    assert pipe.warmup_s is None
    seconds = pipe.warmup()
    assert seconds > 0 and pipe.warmup_s == seconds
    graphs = counters["stats"]["unique_graphs"]
    ctx = run_ids(pipe, prompt)
    batch = [
        pipe.submit(Request(max_new_tokens=4 + n, ignore_eos=True), ids=prompt[: 6 + 3 * n], result=False)
        for n in range(5)
    ]
    for h in batch:
        pipe.wait(h)
    # More requests than max_seqs: some wait; decode steps burst while every place is taken, else run one at a time.
    queued = pipe_of(lm, compile=True, compile_backend="aot_eager")
    queued.max_seqs, queued.stages["decode"] = 2, pipe.stages["decode"]
    for h in [
        queued.submit(Request(max_new_tokens=9, ignore_eos=True), ids=prompt[: 5 + n], result=False) for n in range(5)
    ]:
        queued.wait(h)
    assert counters["stats"]["unique_graphs"] == graphs  # batches of 1 to 5, bursts or not: compiled in the warm-up
    m = pipe.result(ctx).metrics
    assert m["warmup_s"] == seconds and m["decode_compiled"] is True
    assert ctx.generated == oracle(lm, prompt)


def test_a_one_sequence_warmup_builds_the_batch_of_one_graph_that_a_run_then_uses(lm, prompt):
    """``warmup(rows=1)`` (mode=run, mode=chat) builds only what one sequence decodes on: a run
    after it compiles nothing more and equals ``generate()``."""
    from torch._dynamo.utils import counters

    pipe = pipe_of(lm, compile=True, compile_backend="aot_eager")
    before = counters["stats"]["unique_graphs"]
    pipe.warmup(rows=1)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs - before == 1  # the batch of one (a batch of two or more is its own graph)
    ctx = run_ids(pipe, prompt)
    assert counters["stats"]["unique_graphs"] == graphs
    assert ctx.generated == oracle(lm, prompt) and pipe.result(ctx).metrics["decode_compiled"] is True


# --- chunked prefill -------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_prefill_equals_one_shot(lm, prompt, chunk):
    one = pipe_of(lm).run_ids(prompt, Request(max_new_tokens=N, ignore_eos=True))
    chunked = pipe_of(lm, chunk=chunk).run_ids(prompt, Request(max_new_tokens=N, ignore_eos=True))
    assert chunked.generated == one.generated == oracle(lm, prompt)
    assert chunked.cache.length == one.cache.length
    m = chunked.metrics.to_dict()
    assert m["stages"]["prefill"]["calls"] == -(-m["prefill_tokens"] // chunk)  # one forward per chunk
    # Prefill by hand leaves next-token logits: chunking does not change them.
    logits = []
    for c in (None, chunk):
        pipe = pipe_of(lm, chunk=c)
        pipe.pool.clear_prefix_cache()
        ctx = pipe.context(Request(max_new_tokens=1))
        ctx.input_ids, ctx.token_keys = torch.tensor([prompt], device=lm.device), list(prompt)
        Prefill(c)(ctx)
        logits.append(ctx.logits)
    torch.testing.assert_close(logits[0], logits[1])


def test_chunked_prefill_with_3d_positions(load_tiny):
    from stages import VisionEncoder

    vl = load_tiny("qwen2-vl")
    rng = np.random.default_rng(7)
    image = Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8), "RGB")
    request = Request(prompt="What is in the picture?", images=[image], max_new_tokens=8, ignore_eos=True)

    def pipe(chunk: int | None) -> Pipeline:
        stages = {
            "tokenize": Tokenize(),
            "vision_encoder": VisionEncoder(),
            "prefill": Prefill(chunk),
            "decode": DecodeLoop(),
        }
        return Pipeline(vl, stages)

    one = pipe(None).run(request)
    assert one.metrics["image_tokens"] > 7  # the chunks below cut through the image placeholders
    for chunk in (7, 1000):
        pipe(chunk).pool.clear_prefix_cache()
        assert pipe(chunk).run(request).token_ids == one.token_ids


# --- config --------------------------------------------------------------------------------------


def test_config_keys_reach_the_stages_and_the_engine(monkeypatch):
    monkeypatch.delenv("MM_PIPELINE_COMPILE", raising=False)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        default = compose(config_name="config")
        fast = compose(
            config_name="config",
            overrides=[
                "decode.compile=true",
                "prefill.chunk_size=64",
                "kv.memory=0.5",
                "engine.max_seqs=3",
                "engine.burst=1",
            ],
        )
    assert default.decode.compile == "auto" and kv_memory(default) == "auto" and max_seqs(default) is None
    stages = stages_from_cfg(fast)
    assert stages["decode"].compile is True and stages["decode"].compiled is not None
    assert stages["prefill"].chunk_size == 64
    assert kv_memory(fast) == 0.5 and max_seqs(fast) == 3
    assert engine_settings(fast)["burst"] == 1 and engine_settings(default)["burst"] == 8
    auto = stages_from_cfg(default)["decode"]
    assert auto.compile == "auto" and auto.compiled.auto and not auto.compiled.ready.is_set()


@pytest.mark.parametrize(
    "override, message",
    [
        ("kv.memory=-1", "kv.memory must be auto"),
        ("kv.memory=1.5", "kv.memory must be auto"),
        ("engine.max_seqs=0", "engine.max_seqs must be"),
        ("engine.max_batch_tokens=0", "engine.max_batch_tokens must be"),
        ("kv.block_size=0", "kv.block_size must be"),
        ("engine.burst=0", "engine.burst must be"),
    ],
)
def test_bad_engine_settings_are_refused_where_the_config_enters(override, message):
    from pipeline.cli.settings import check

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[override])
    with pytest.raises(UserError, match=message) as err:
        check(cfg)  # what the CLI runs before any mode reads a setting
    assert "\n" not in str(err.value)


@pytest.mark.slow  # a second full compile and warm-up; decode.compile's warm-up runs in the default run
def test_stage_level_compile_is_warmed_up_like_decode_compile(lm):
    """``stages.decode.compile=true`` set directly compiles and warms up exactly as
    ``decode.compile=true`` does: the stage decides, so the two settings cannot disagree."""
    from pipeline.cli.assemble import pipeline_from_cfg

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=["stages.decode.compile=true", "+stages.decode.compile_backend=aot_eager", f"kv.memory={POOL}"],
        )
    assert cfg.decode.compile == "auto"  # (the default: the stage's own setting is what asks)
    pipe = pipeline_from_cfg(cfg, lm)
    assert pipe.stages["decode"].compiled is not None and pipe.warmup_s is not None


def test_inductors_caches_go_to_the_projects_folder_unless_one_is_named(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from pipeline.runner.inductor_cache import CACHE_ENV, use_project_cache

    monkeypatch.setenv(CACHE_ENV, default_cache_dir())  # what importing torch._dynamo writes there
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "mm-pipeline" / "torchinductor"
    assert use_project_cache() == str(folder) and folder.is_dir()
    assert os.environ[CACHE_ENV] == str(folder)  # what Inductor reads when it first compiles
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert use_project_cache() == str(tmp_path / "mine")  # a folder the user names is kept


def test_inductors_compiler_checks_are_asked_once_across_processes(monkeypatch, tmp_path):
    """Inductor checks in every process that the compiler builds each vector instruction set
    (a fresh ``python -c "import torch"`` each, 1.5 s): a check passed once is answered from the
    cache folder, as in a new process (a new wrapper); one that failed is asked again."""
    from torch._inductor import cpu_vec_isa

    from pipeline.runner.inductor_cache import ISA_FILE, remember_isa_checks

    asked = []

    def check_build(self, code):  # stands for torch's: compile a probe, load it in a subprocess
        asked.append(code)
        return "good" in code

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", check_build)
    isa = cpu_vec_isa.VecAVX2()
    assert remember_isa_checks(tmp_path)
    assert isa.check_build("good probe") and asked == ["good probe"]
    assert not isa.check_build("bad probe") and asked == ["good probe", "bad probe"]
    assert (tmp_path / ISA_FILE).is_file()
    assert remember_isa_checks(tmp_path)  # the next process: wraps torch's check again, not the wrapper
    assert isa.check_build("good probe") and not isa.check_build("bad probe")
    assert asked == ["good probe", "bad probe", "bad probe"]
    assert cpu_vec_isa.VecAVX512().check_build("good probe")  # other flags: another check
    assert asked[-1] == "good probe" and len(asked) == 4
