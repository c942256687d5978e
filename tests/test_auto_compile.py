"""``decode.compile=auto``, the default: the decode step is compiled beside the engine, which
answers eagerly meanwhile and switches once the graphs are ready, with the same tokens; a one-shot
run waits only for a compile Inductor has cached and otherwise leaves one for the next run.

Auto compiles only where it pays: on CPU with the native kernels. The suite's tiny models have no
layer large enough for them, so here a held-out Llama (``save_pretrained``, no project marker:
``quant=auto`` loads it in int8wo, the CPU default) is built with layers the kernels take.
Compiling tests run Inductor (the only backend auto builds beside the engine) in processes and
cache folders of their own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import ROOT, generate_oracle, run_cli
from pipeline import Pipeline, Request, UserError, load_model
from pipeline.runner import compile_ahead, compiled, inductor_cache, matvec, saved_step
from pipeline.runner.compiled import CompiledStep
from stages import DecodeLoop, Prefill
from stages.decode import FastPathFallback

pytestmark = pytest.mark.skipif(matvec.load() is not None, reason=f"no native kernels: {matvec.load()}")

N = 12
POOL = 1 << 22


@pytest.fixture(scope="module")
def kernel_sized(tiny_dir, tmp_path_factory) -> Path:
    """A Llama saved as a user's checkpoint: the tiny Llama's tokenizer, layers of 256 x 512 (the
    native kernels' size), random weights, no project marker."""
    source = tiny_dir("llama")
    config = LlamaConfig.from_pretrained(source)
    config.update(dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2))
    config.head_dim = 64
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("kernel-sized")
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


@pytest.fixture(scope="module")
def lm(kernel_sized):
    lm = load_model(str(kernel_sized), quant="auto")  # the command line's default: int8wo on a CPU
    assert lm.quant == "int8wo"
    return lm


def prompts(lm) -> list[list[int]]:
    text = "The sea and the sky meet where the light of the morning falls on the water"
    ids = lm.tokenizer(text)["input_ids"]
    return [ids[: 6 + 3 * i] for i in range(5)]


def oracle(lm, ids: list[int], n: int = N) -> list[int]:
    return generate_oracle(lm, torch.tensor([ids], device=lm.device), n, ignore_eos=True)


def submit(pipe: Pipeline, ids: list[int], n: int = N, **request):
    return pipe.submit(Request(max_new_tokens=n, ignore_eos=True, **request), ids=ids, result=False)


def in_own_process(script: str, model_dir: Path, tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``script`` run on ``model_dir`` (and ``args``) by a Python of its own, Inductor's caches in
    ``tmp_path`` (``env``: more variables)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), **env}
    command = [sys.executable, "-c", script, str(model_dir), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


SWITCH_SCRIPT = """
import json, sys, threading, warnings, torch, torch.fx
sys.path.insert(0, "tests")
traced_on = []  # threads where torch.fx's own tracer (its call_module not overridden) traced
plain_trace = torch.fx.Tracer.trace
def trace(self, *args, **kwargs):
    if type(self).call_module is torch.fx.Tracer.call_module:
        traced_on.append(threading.current_thread().name)
    return plain_trace(self, *args, **kwargs)
torch.fx.Tracer.trace = trace
from torch._dynamo.utils import counters
from conftest import generate_oracle
from pipeline import Pipeline, Request, load_model
from stages import DecodeLoop, Prefill, Sampler
from stages.decode import FastPathFallback
warnings.simplefilter("error", FastPathFallback)
lm = load_model(sys.argv[1], quant="auto")
text = "The sea and the sky meet where the light of the morning falls on the water"
ids = lm.tokenizer(text)["input_ids"]
prompts = [ids[: 6 + 3 * i] for i in range(5)]
def submit(pipe, p, n=12, **request):
    return pipe.submit(Request(max_new_tokens=n, ignore_eos=True, **request), ids=p, result=False)
def oracle(ctx):
    return generate_oracle(lm, ctx.input_ids, len(ctx.generated), ignore_eos=True)
pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(compile="auto")}, kv_memory=1 << 22)
step = pipe.engine.runner.compiled
pipe.compile_ahead(apart=sys.argv[2] == "apart")  # as chat (apart) or serve start it
# The first requests decode eagerly beside the build.
during = [pipe.wait(submit(pipe, p, n=40)) for p in prompts[:2]]
building = not step.ready.is_set()
before = pipe.engine.stats()
waited = pipe.compile_ahead(wait=True)
after = pipe.engine.stats()
from prometheus_client import generate_latest
from pipeline.serve.prometheus import ServerMetrics
exposition = generate_latest(ServerMetrics(pipe.engine).registry).decode()
graphs = counters["stats"]["unique_graphs"]
greedy = [submit(pipe, p) for p in prompts]  # a batch of 5: decode bursts
solo = pipe.wait(submit(pipe, prompts[0]))  # a batch of 1
sampled = [submit(pipe, p, sampler=Sampler(temperature=0.8, seed=7)) for p in prompts[:3]]
greedy, sampled = [pipe.wait(h) for h in greedy], [pipe.wait(h) for h in sampled]
eager = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(compile=False)}, kv_memory=1 << 22)
again = [eager.wait(submit(eager, p, sampler=Sampler(temperature=0.8, seed=7))) for p in prompts[:3]]
print(json.dumps({
    "building": building, "waited": waited, "broken": step.broken,
    "stats": [s[k] for s in (before, after) for k in ("decode_compiled", "decode_compile_s")],
    "gauge": "mm_decode_compiled 1.0" in exposition and "mm_decode_compile_seconds" in exposition,
    "graphs_after": counters["stats"]["unique_graphs"] - graphs,
    "during": [c.generated == oracle(c) for c in during],
    "during_eager": [c.metrics.info["decode_compiled"] for c in during],
    "greedy": [c.generated == oracle(c) for c in [*greedy, solo]],
    "solo_compiled": pipe.result(solo).metrics["decode_compiled"],
    "sampled": [c.generated for c in sampled] == [c.generated for c in again],
    "traced_on": traced_on,
    "record": pipe.compile_record(),
}))
"""


@pytest.mark.parametrize("where", ["thread", pytest.param("apart", marks=pytest.mark.slow)])  # (the suite's 10 min)
def test_the_engine_answers_while_the_step_compiles_beside_it_then_switches(kernel_sized, tmp_path, where):
    """With Inductor, in a process of its own (the CLI's path; test_compiled.py says why apart)
    and a cache folder of its own (a first compile, so the build outlasts the first answers); the
    first compile on the build's thread (serve, batch) or in a process of its own (chat)."""
    proc = in_own_process(SWITCH_SCRIPT, kernel_sized, tmp_path, where)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["building"] and got["waited"] > 0 and got["broken"] is None
    assert got["stats"][:3] == [False, None, True] and got["stats"][3] > 0 and got["gauge"]  # /metrics says so
    assert got["during"] == [True, True] and got["during_eager"] == [False, False]
    assert got["greedy"] == [True] * 6 and got["solo_compiled"] is True and got["sampled"]
    assert got["graphs_after"] == 0  # the engine's own steps compiled nothing
    # torch.fx's tracer patches nn.Module.__call__ process-wide: a module the engine called meanwhile
    # would fail. None of it may run on the build's thread (Inductor's once-a-process trace is done before).
    assert compile_ahead.THREAD_NAME not in got["traced_on"]
    # Apart, the first compile ran in a process of its own (``compile_apart``) and the engine's
    # thread then built from Inductor's caches: both are in the record.
    assert ("cached_s" in got["record"]) == (where == "apart") and "first_s" in got["record"]


@pytest.mark.parametrize("apart", [False, True])
def test_a_process_that_exits_while_the_step_compiles_exits_cleanly(kernel_sized, tmp_path, apart):
    """A first compile cut short by the process ending (a one-shot run interrupted, a server
    stopped) neither crashes the interpreter nor leaves a compiler process behind, on the build's
    thread or in a process of its own (``compile_apart``)."""
    script = (
        "import sys, time\n"
        "from pipeline import Pipeline, load_model\n"
        "from stages import DecodeLoop, Prefill\n"
        "lm = load_model(sys.argv[1], quant='auto')\n"
        "pipe = Pipeline(lm, {'prefill': Prefill(), 'decode': DecodeLoop(compile='auto')}, kv_memory=1 << 22)\n"
        f"pipe.compile_ahead(apart={apart})\n"
        "time.sleep(3)\n"
        "print('pending', pipe.compile_pending)\n"
        "sys.path.insert(0, 'tests')\n"
        "from test_auto_compile import processes_naming\n"
        "import os\n"
        "print('apart', len(processes_naming(os.environ['TMPDIR'])))\n"
    )
    proc = in_own_process(script, kernel_sized, tmp_path, TMPDIR=str(tmp_path))
    assert proc.returncode == 0 and "pending True" in proc.stdout, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr
    # the first compile's own process (its spec in this test's folder) ran, and ended with it
    assert f"apart {int(apart)}" in proc.stdout
    deadline = time.monotonic() + 30
    while processes_naming(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_naming(tmp_path)


def processes_naming(folder: Path) -> list[str]:
    """The command lines of running processes that name ``folder`` (Linux ``/proc``; none elsewhere)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in text and "compile_apart" in text:
            found.append(text)
    return found


def test_an_exit_cancel_that_a_callback_swallows_is_raised_again_and_kept_off_stderr(monkeypatch):
    """The cancel lands at whatever line of Python the build runs: in a weakref callback or a
    ``__del__`` CPython reports it as unraisable and the build runs on (seen in CI). It is raised
    again until the build ends, and its unraisable report is not printed."""
    done, swallowed = threading.Event(), []

    def build() -> None:
        try:
            while not swallowed:
                try:
                    while True:
                        time.sleep(0.001)
                except compile_ahead.CompileCancelled as exc:  # what a callback's caller does
                    swallowed.append(exc)
            while True:
                time.sleep(0.001)
        except compile_ahead.CompileCancelled:
            pass
        finally:
            done.set()

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    start = time.monotonic()
    compile_ahead._cancel(thread, done)
    assert done.is_set() and len(swallowed) == 1 and time.monotonic() - start < 5
    thread.join(5)
    assert not thread.is_alive()
    sys.unraisablehook(SimpleNamespace(exc_value=compile_ahead.CompileCancelled()))
    other = SimpleNamespace(exc_value=ValueError("a real error"))
    sys.unraisablehook(other)
    assert reported == [other]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread CPU priority is Linux's")
def test_the_build_beside_the_engine_runs_below_its_cpu_priority():
    """The engine's steps come first where they compete for cores with the build; a build run on
    the calling thread (another backend) leaves that thread's priority alone."""

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen: list[int] = []
    step = SimpleNamespace(backend="inductor", build=lambda *a: seen.append(priority()) or 0.0, why_not=lambda lm: None)
    mine = priority()
    compile_ahead.start(step, None, None, 1, False, None).join(10)
    step.backend = "aot_eager"
    assert compile_ahead.start(step, None, None, 1, False, None) is None
    assert seen == [min(19, mine + compile_ahead.NICE), mine] and priority() == mine


def test_builds_hand_the_gil_over_often_and_the_last_one_to_end_restores_the_interval():
    """An eager step waits for the GIL after each torch call: while builds run, the interval is
    short; it is what it was once the last of two overlapping builds ends, whichever ends first."""
    mine = sys.getswitchinterval()
    release = {"first": threading.Event(), "second": threading.Event()}
    seen: dict[str, list[float]] = {"first": [], "second": []}

    def build(name: str) -> float:
        seen[name].append(sys.getswitchinterval())
        release[name].wait(10)
        seen[name].append(sys.getswitchinterval())
        return 0.0

    threads = {}
    for name in ("first", "second"):
        step = SimpleNamespace(backend="inductor", build=lambda *a, name=name: build(name), why_not=lambda lm: None)
        threads[name] = compile_ahead.start(step, None, None, 1, False, None)
    release["first"].set()
    threads["first"].join(10)
    short = pytest.approx(compile_ahead.SWITCH_S)  # (Python keeps it in whole microseconds)
    assert sys.getswitchinterval() == short  # the second build still runs
    release["second"].set()
    threads["second"].join(10)
    assert [*seen["first"], *seen["second"]] == [short] * 4
    assert sys.getswitchinterval() == pytest.approx(mine)


def test_auto_stays_eager_without_a_word_where_compiling_does_not_pay(lm, load_tiny):
    cases = {
        "no native kernels": (lm, DecodeLoop(compile="auto", matvec=False)),
        "layers too small for them": (load_tiny("qwen3"), DecodeLoop(compile="auto")),
    }
    for why, (model, decode) in cases.items():
        pipe = Pipeline(model, {"prefill": Prefill(), "decode": decode}, kv_memory=POOL)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            ctx = pipe.run_ids(prompts(model)[0], Request(max_new_tokens=N, ignore_eos=True))
        assert pipe.engine.runner.compiled is None, why
        assert not [t for t in threading.enumerate() if t.name == compile_ahead.THREAD_NAME], why
        assert not [w for w in record if issubclass(w.category, FastPathFallback)], why
        assert ctx.generated == oracle(model, ctx.input_ids[0].tolist()), why


def test_a_one_shot_run_answers_eagerly_and_leaves_the_compile_for_the_next_run(kernel_sized, tmp_path):
    """The command line's defaults, run three times: the first answers at once on the eager step
    and compiles after its answer; the second waits for Inductor's cached graphs (how long that
    takes is not known yet) and decodes on them; the third knows the wait is longer than its
    short answer takes eagerly, and answers eagerly without compiling. The same tokens each time."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # a first compile, then its cache
    runs, saved = [], []
    for i in range(3):
        args = [f"model.path={kernel_sized}", "prompt=Tell me about the sea", "max_new_tokens=16", "ignore_eos=true"]
        out = run_cli(*args, f"hydra.run.dir={tmp_path / str(i)}", env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append((out.stderr, json.loads((tmp_path / str(i) / "result.json").read_text())))
        saved.append({p.name: p.stat().st_mtime_ns for p in (tmp_path / "inductor" / saved_step.FOLDER).glob("*")})
    # The first run saved the single-row step whole; the second loaded it (a step traced anew is saved anew).
    assert len(saved[0]) == 1 and saved[0] == saved[1] == saved[2]
    (first_err, first), (second_err, second), (third_err, third) = runs
    assert first["metrics"]["decode_compiled"] is False and "warmup_s" not in first["metrics"]
    assert "compiling the decode step, so that the next run starts compiled" in first_err
    assert second["metrics"]["decode_compiled"] is True and second["metrics"]["warmup_s"] > 0
    assert "decode step compiled in" in second_err and "so that the next run" not in second_err
    assert third["metrics"]["decode_compiled"] is False and "warmup_s" not in third["metrics"]
    assert "decoding eagerly: the cached compile" in third_err and "compiling the decode step" not in third_err
    assert first["token_ids"] == second["token_ids"] == third["token_ids"]
    record = json.loads((tmp_path / "inductor" / "mm-pipeline-compiled.json").read_text())
    assert [sorted(entry) for entry in record.values()] == [["cached_runs", "cached_s", "eager_token_s", "first_s"]]


def test_first_requests_from_many_threads_start_one_build(lm, monkeypatch):
    """Eight threads asking at once for the build (their first submits) share one build."""
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(compile="auto")}, kv_memory=POOL)
    started = []

    def start(step, *args):  # compile_ahead.start without the compile: slow enough to race
        time.sleep(0.05)
        started.append(step)
        return threading.Thread(target=lambda: None)

    monkeypatch.setattr(compile_ahead, "start", start)
    with ThreadPoolExecutor(8) as pool:
        builders = list(pool.map(lambda _: pipe.engine.runner.compile_ahead(), range(8)))
    assert len(started) == 1 and len({id(b) for b in builders}) == 1 and builders[0] is not None


def test_a_cached_compile_is_waited_for_only_where_it_pays(lm, monkeypatch):
    """A one-shot run's rule (``Pipeline.compile_pays``): never a first compile; a cached one
    once to measure its wait, then only where the wait is shorter than the answer eagerly."""
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(compile="auto")}, kv_memory=POOL)
    record: dict[str, float] = {}
    monkeypatch.setattr(pipe, "compile_record", lambda rows=None: record)
    assert not pipe.compile_pays(64)
    record.update(first_s=30.0, eager_token_s=0.008)
    assert pipe.compile_pays(64)  # the cached wait is not known yet
    record.update(cached_s=3.5)
    assert not pipe.compile_pays(64) and not pipe.compile_pays(437) and pipe.compile_pays(438)


def test_one_slow_cached_build_does_not_turn_the_wait_off(monkeypatch, tmp_path):
    """``cached_s`` is the median of the last cached builds: one build slowed by a profiler or a
    busy machine (36.7 s under py-spy against 9.6) no longer makes the next one-shot runs decode
    eagerly; a slower machine for good moves it within three builds."""
    monkeypatch.setenv(inductor_cache.CACHE_ENV, str(tmp_path))
    inductor_cache.remember("step", first_s=60.0)
    for seconds in (9.6, 9.4, 36.7):
        inductor_cache.remember_cached("step", seconds)
    assert inductor_cache.compile_record("step")["cached_s"] == 9.6
    for seconds in (30.0, 31.0):
        inductor_cache.remember_cached("step", seconds)
    record = inductor_cache.compile_record("step")
    assert record["cached_s"] == 30.0 and record["first_s"] == 60.0
    for _ in range(4):
        inductor_cache.remember_cached("step", 30.0)
    assert len(inductor_cache.compile_record("step")["cached_runs"]) == inductor_cache.CACHED_RUNS


def test_a_compile_that_failed_here_is_not_tried_again_by_auto(lm, monkeypatch, tmp_path):
    """Where the step's compile failed, later processes with ``auto`` stay eager without trying
    again (each would spend its CPU beside the engine to fail again, or hold a one-shot run's exit
    for it); ``decode.compile=true`` tries again."""
    monkeypatch.setenv(inductor_cache.CACHE_ENV, str(tmp_path))  # this test's own record
    tries: list[bool] = []

    def failing(self, fn, model):  # torch.compile's errors come at the first call
        def step(*args):
            tries.append(self.auto)
            raise RuntimeError("the C++ compiler failed on this graph")

        return step

    monkeypatch.setattr(CompiledStep, "_compile", failing)

    def pipe(mode):
        return Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(compile=mode)}, kv_memory=POOL)

    first = pipe("auto")
    first.compile_ahead(1, wait=True)
    assert tries and set(tries) == {True} and "the C++ compiler failed" in first.compile_failed
    assert "failed_s" in first.compile_record(1) and "first_s" not in first.compile_record(1)
    tried = len(tries)
    again = pipe("auto")
    again.compile_ahead(1, wait=True)
    assert len(tries) == tried and again.compile_failed == compiled.FAILED_BEFORE
    ids = prompts(lm)[0]
    assert again.run_ids(ids, Request(max_new_tokens=N, ignore_eos=True)).generated == oracle(lm, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FastPathFallback)
        asked = pipe(True).run_ids(ids, Request(max_new_tokens=N, ignore_eos=True))
    assert False in tries[tried:] and asked.generated == oracle(lm, ids)


def test_a_compile_for_a_pool_of_another_size_is_not_taken_as_cached(lm, monkeypatch, tmp_path):
    """The graphs have the pool's shape (another ``kv.memory``, or ``auto`` on a machine with
    less RAM free, compiles anew: measured, 254M Llama, 34 s then 32 s), so a one-shot run must
    not wait for such a compile as if it were cached: the record is per pool size."""
    monkeypatch.setenv(inductor_cache.CACHE_ENV, str(tmp_path))  # this test's own record
    monkeypatch.setattr(CompiledStep, "_compile", lambda self, fn, model: fn)  # eager: the record is what counts

    def pipe(kv_memory):
        return Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(compile="auto")}, kv_memory=kv_memory)

    pipe(POOL).compile_ahead(1, wait=True)
    assert pipe(POOL).compile_cached(1)
    other = pipe(2 * POOL)
    assert other.pool.num_blocks != pipe(POOL).pool.num_blocks and not other.compile_cached(1)


def test_a_compile_recorded_under_other_code_is_not_taken_as_cached(lm, monkeypatch, tmp_path):
    """The record is kept under the digest the saved step's name has (``saved_step.library_code``:
    every source file, the native kernels' too). Under a narrower one, an edit of a kernel kept
    the record while the saved step was named anew: a one-shot run waited for a trace of the new
    code (6.2 s here), recorded that as the cached wait, and every later run of 128 tokens (2.6 s
    eagerly) stayed eager beside a saved step that loads in 1 s."""
    monkeypatch.setenv(inductor_cache.CACHE_ENV, str(tmp_path))  # this test's own record
    monkeypatch.setattr(CompiledStep, "_compile", lambda self, fn, model: fn)  # eager: the record is what counts

    def pipe():
        return Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(compile="auto")}, kv_memory=POOL)

    monkeypatch.setattr(saved_step, "library_code", lambda: "the source before")
    pipe().compile_ahead(1, wait=True)
    assert pipe().compile_cached(1)
    monkeypatch.setattr(saved_step, "library_code", lambda: "a kernel edited")
    assert not pipe().compile_cached(1) and pipe().compile_record(1) == {}


def test_a_bad_compile_setting_is_refused_in_one_line():
    out = run_cli("decode.compile=maybe", "model.path=/nonexistent")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "decode.compile must be true, false or auto (got 'maybe')" in out.stderr.strip().splitlines()[-1]


def test_a_bad_compile_default_in_the_environment_is_refused_as_the_setting_is(monkeypatch):
    """``MM_PIPELINE_COMPILE`` reaches the same check (the config reads it), in a process here:
    the command line's one-line handling of a ``UserError`` is the case above."""
    from hydra import compose, initialize_config_dir

    from pipeline.cli.settings import check

    monkeypatch.setenv("MM_PIPELINE_COMPILE", "sometimes")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config")
    with pytest.raises(UserError, match=r"decode.compile must be true, false or auto \(got 'sometimes'\)"):
        check(cfg)


def test_ctrl_c_skips_the_compile_after_a_runs_answer_and_the_run_still_ends_well(kernel_sized, tmp_path):
    """The first run's compile after its answer is skipped with Ctrl-C: the answer is kept, the
    process ends with status 0 (a join interrupted by Ctrl-C once hid the build from the exit's
    cancel, and the interpreter aborted under it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    args = [f"model.path={kernel_sized}", "prompt=Hi", "max_new_tokens=8", f"hydra.run.dir={tmp_path / 'run'}"]
    # Ctrl-C's handler put back in the child: a shell without job control starts a background
    # job, such as a suite run with ``cmd &``, with SIGINT ignored, and Python keeps an inherited
    # SIG_IGN. Put back by the child's Python, not a ``preexec_fn``: that makes Popen fork the
    # whole pytest worker, which failed with ENOMEM where the worker had reserved big KV pools.
    main = "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    main += "runpy.run_module('pipeline', run_name='__main__', alter_sys=True)"
    proc = subprocess.Popen([sys.executable, "-c", main, *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "compiling the decode step" in line:
            time.sleep(2)
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, rest[-3000:]
    assert "compile skipped" in rest and "terminate called" not in rest
    assert json.loads((tmp_path / "run" / "result.json").read_text())["token_ids"]


@pytest.mark.slow
def test_the_compile_beside_benchmark_sees_the_switch_and_no_lost_answer(kernel_sized, tmp_path):
    """``benchmarks/compile_beside.py`` on a user's checkpoint: a fresh server's answers through
    the ``openai`` client until after the switch, which it reads from ``/metrics``."""
    figures = tmp_path / "figures.json"
    script = ROOT / "benchmarks" / "compile_beside.py"
    command = [sys.executable, str(script), "--model", str(kernel_sized), "--seconds", "150", "--tokens", "16"]
    proc = subprocess.run([*command, "--json", str(figures)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(figures.read_text())
    assert got["failed"] == 0 and got["first_s"] > 0 and got["before_max_s"] >= got["first_s"]
    assert 0 < got["switch_s"] < 150 and got["after_median_s"] > 0 and got["answers"] > 2
