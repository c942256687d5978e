"""The GPU check's figures from one Python process (issue 47), in order of value.

GPU time comes rarely and briefly (15 minutes a session, the machine's start included), and the
lent machines' host takes about 20 s to import torch and transformers: so the imports are paid
once, each model is built or loaded once, and each step writes its JSON (``OUT/NAME.json``) and
a line of ``OUT/steps.jsonl`` (exit 0, 1 on an error, 124 past its time limit) the moment it
ends, so that a run cut short still brings back every figure that finished.

Steps, in this order (``--steps`` picks some):

- ``env``: versions, the device, and a device copy's bandwidth (the roofline);
- ``decode_bf16``: bf16 decode of the Qwen2-VL-2B architecture (random weights, a 448x448 image
  and 32 text tokens, 128 new) against ``generate()``: CUDA graphs (the default) and eager, with
  the share of HBM bandwidth;
- ``decode_nf4`` / ``decode_int4wo``: the same in 4-bit weights (bitsandbytes nf4, torchao int4);
- ``batch``: 64 requests at once against the same requests one at a time (bf16, the engine);
- ``prefill_16k``: a 16,384-token text prompt's time to first token against ``generate()``;
- ``decode_bf16_flex``: attention through FlexAttention (``kv.attention=flex``) against SDPA
  over gathered keys, both under CUDA graphs;
- ``decode_bf16_compiled``: ``decode.compile=true`` (Inductor), warm-up included in its figure.

``--rehearse``: the same steps, code and files at tiny size on the CPU (one decoder layer and
one vision block of the real widths, a few tokens; int8wo stands in for the 4-bit schemes, which
need CUDA): what ``REHEARSE=1 bash benchmarks/gpu_check.sh`` runs before a GPU is spent.

    python benchmarks/gpu_figures.py --out gpu-check            # on the GPU (gpu_check.sh runs it)
    python benchmarks/gpu_figures.py --out /tmp/rehearsal --rehearse
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from archs import build_qwen2_vl_2b  # noqa: E402
from decode_vs_generate import Prompt, copy_gb_s, make_pipe, measure, print_rows  # noqa: E402
from engine_throughput import run_engine  # noqa: E402

from pipeline import Pipeline, load_model  # noqa: E402
from pipeline.model.loading import LoadedModel  # noqa: E402
from pipeline.metrics import decode_weight_bytes  # noqa: E402
from stages import DecodeLoop, Prefill  # noqa: E402

STEPS = (
    "env",
    "decode_bf16",
    "decode_nf4",
    "decode_int4wo",
    "batch",
    "prefill_16k",
    "decode_bf16_flex",
    "decode_bf16_compiled",
)


@dataclass
class Sizes:
    """What the steps run at: the GPU's figures, or the rehearsal's tiny version of them."""

    layers: int | None = None  # None: the architecture's own (28 decoder layers, 32 vision blocks)
    image: int = 448
    prompt_tokens: int = 32
    new_tokens: int = 128
    reps: int = 2
    requests: int = 64
    batch_new_tokens: int = 32
    prefill_tokens: int = 16384
    kv_memory: int = 8 << 30
    limits: tuple[int, ...] = (20, 150, 90, 90, 90, 60, 100, 180)  # seconds per step, in STEPS order


GPU = Sizes()
REHEARSAL = Sizes(
    layers=1,
    image=56,
    prompt_tokens=8,
    new_tokens=6,
    reps=1,
    requests=4,
    batch_new_tokens=4,
    prefill_tokens=256,
    kv_memory=256 << 20,
    limits=(20, 120, 60, 60, 60, 60, 120, 200),
)


class StepTimeout(Exception):
    """A step ran past its limit (SIGALRM)."""


class Run:
    """The steps' shared state: the arguments, the bf16 model (loaded once) and the output folder."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sizes = REHEARSAL if args.rehearse else GPU
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.peak = args.peak_gb_s
        self._bf16: LoadedModel | None = None
        cache = Path(args.cache_dir or Path(tempfile.gettempdir()) / "mm-pipeline-bench")
        self.model_dir = cache / (
            "qwen2-vl-2b" if self.sizes.layers is None else f"qwen2-vl-2b-{self.sizes.layers}-layer"
        )

    def model_path(self) -> str:
        s = self.sizes
        return str(build_qwen2_vl_2b(self.model_dir, self.device, layers=s.layers, vision_depth=s.layers))

    def bf16(self) -> LoadedModel:
        if self._bf16 is None:
            self._bf16 = load_model(self.model_path(), dtype="bfloat16", quant="none")
        return self._bf16

    def pipe(self, lm: LoadedModel, image: bool, **options: Any) -> Pipeline:
        """``make_pipe`` on a pool of the run's size (``options``: ``fast``, ``cuda_graphs``, ``kv_attention``)."""
        fast = bool(options.pop("fast", False))
        return make_pipe(lm, fast, image, kv_memory=self.sizes.kv_memory, **options)

    def roofline(self) -> float:
        if self.peak is None:
            self.peak = copy_gb_s()
        return self.peak


# --- the steps ------------------------------------------------------------------------------------


def step_env(run: Run) -> dict:
    import accelerate
    import transformers

    figures = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "device": torch.cuda.get_device_name() if run.device == "cuda" else platform.processor() or "cpu",
    }
    for name in ("bitsandbytes", "torchao", "triton"):
        try:
            figures[name] = __import__(name).__version__
        except Exception as err:  # absent or broken: say which, the steps that need it will fail on their own
            figures[name] = f"unavailable ({type(err).__name__})"
    figures["copy_gb_s"] = run.roofline()
    print(json.dumps(figures))
    return figures


def decode_rows(run: Run, lm: LoadedModel, paths: dict[str, dict]) -> dict:
    """``measure`` on the image prompt for pipelines built with each path's options."""
    s = run.sizes
    args = argparse.Namespace(image=s.image, prompt_tokens=s.prompt_tokens)
    prompt = Prompt(lm, args)
    pipes = {name: run.pipe(lm, True, **options) for name, options in paths.items()}
    warmup = {name: p.warmup() for name, p in pipes.items()}  # compiles, captures: before any timing
    rows = measure(lm, prompt, pipes, s.new_tokens, s.reps, run.roofline())
    print_rows(rows, run.peak)
    return {
        "paths": {name: step_notes(p) for name, p in pipes.items()},
        "model": lm.path,
        "quant": lm.quant,
        "dtype": str(lm.model.dtype),
        "device": str(lm.device),
        "decode_weight_bytes": decode_weight_bytes(lm.model, lm.family.encoder_modules),
        "prompt_tokens": prompt.length,
        "new_tokens": s.new_tokens,
        "reps": s.reps,
        "warmup_s": warmup,
        "roofline_gb_s": run.peak,
        "rows": rows,
    }


def step_notes(pipe: Pipeline) -> dict:
    """How a path's decode step really ran: CUDA graphs captured (buckets) or why not, whether
    FlexAttention fell back, the runner's fixed-shape step."""
    from pipeline.runner import flex

    decode = pipe.stages["decode"]
    graphed = getattr(decode, "graphed", None)
    runner = pipe.engine.runner
    notes = {
        "fixed_step": getattr(runner.compiled, "kind", None),
        "flex_broken": flex.KERNEL.broken,
        "attention": pipe.pool.attention,
    }
    if graphed is not None:
        notes.update(graphs_broken=graphed.broken, buckets=sorted(str(k) for b in graphed.buckets.values() for k in b))
    if decode.compiled is not None:
        notes.update(compile_broken=decode.compiled.broken, compiled_shapes=sorted(decode.compiled.shapes))
    print(f"   {json.dumps(notes)[:400]}", file=sys.stderr)
    return notes


def step_decode_bf16(run: Run) -> dict:
    return decode_rows(run, run.bf16(), {"cuda_graphs": {}, "eager": {"cuda_graphs": False}})


def quantised_decode(run: Run, scheme: str) -> dict:
    """One 4-bit scheme against generate(); on CPU (the rehearsal) int8wo stands in for it."""
    quant = scheme if run.device == "cuda" else "int8wo"
    lm = load_model(run.model_path(), dtype="bfloat16", quant=quant)
    try:
        figures = decode_rows(run, lm, {"cuda_graphs": {}, "eager": {"cuda_graphs": False}})
        return {**figures, "scheme": scheme, "stand_in": quant if quant != scheme else None}
    finally:
        del lm
        release()


def step_decode_nf4(run: Run) -> dict:
    return quantised_decode(run, "nf4")


def step_decode_int4wo(run: Run) -> dict:
    return quantised_decode(run, "int4wo")


def step_batch(run: Run) -> dict:
    """Aggregate decode throughput of ``requests`` at once (engine.max_seqs = requests) against
    the same requests one at a time (max_seqs 1), bf16, CUDA graphs (the default)."""
    from engine_throughput import workload

    s = run.sizes
    lm = run.bf16()
    prompts = workload(
        lm, argparse.Namespace(requests=s.requests, min_prompt=20, max_prompt=90, shared_prefix=0, seed=0)
    )
    figures = {}
    for name, max_seqs in (("one_at_a_time", 1), ("at_once", s.requests)):
        pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, max_seqs=max_seqs, kv_memory=s.kv_memory)
        pipe.warmup()
        run_engine(pipe, prompts, 2 if max_seqs == 1 else s.batch_new_tokens, at_once=True)  # every bucket captured
        seconds, tokens, _ = run_engine(pipe, prompts, s.batch_new_tokens, at_once=True)
        figures[name] = {
            "max_seqs": max_seqs,
            "seconds": seconds,
            "tok_s": len(prompts) * s.batch_new_tokens / seconds,
            "tokens": tokens,
        }
    solo, batch = figures["one_at_a_time"], figures["at_once"]
    same = sum(a == b for a, b in zip(solo.pop("tokens"), batch.pop("tokens")))
    result = {
        "requests": s.requests,
        "new_tokens": s.batch_new_tokens,
        **figures,
        "notes": step_notes(pipe),
        "speedup": batch["tok_s"] / solo["tok_s"],
        "sequences_identical": same,
    }
    print(
        f"{s.requests} requests x {s.batch_new_tokens} tokens: one at a time {solo['tok_s']:.1f} tok/s, "
        f"at once {batch['tok_s']:.1f} tok/s: {result['speedup']:.1f}x ({same}/{s.requests} identical)"
    )
    return result


def step_prefill_16k(run: Run) -> dict:
    """Time to first token of a long text prompt, the pipeline against generate()."""
    s = run.sizes
    lm = run.bf16()
    prompt = Prompt(lm, argparse.Namespace(image=0, prompt_tokens=s.prefill_tokens))
    pipes = {"pipeline": run.pipe(lm, False)}
    rows = measure(lm, prompt, pipes, 8, 1, run.roofline())
    print_rows(rows, run.peak)
    return {
        "prompt_tokens": prompt.length,
        "rows": rows,
        "notes": step_notes(pipes["pipeline"]),
        "ttft_ratio": rows[1]["prefill_ratio"],
    }  # generate's TTFT / the pipeline's


def step_decode_bf16_flex(run: Run) -> dict:
    return decode_rows(run, run.bf16(), {"sdpa": {"kv_attention": "sdpa"}, "flex": {"kv_attention": "flex"}})


def step_decode_bf16_compiled(run: Run) -> dict:
    return decode_rows(run, run.bf16(), {"compiled": {"fast": True}})


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- running them ---------------------------------------------------------------------------------


def run_step(run: Run, name: str, fn: Callable[[Run], dict], limit: int) -> int:
    """One step under its time limit; its JSON and its steps.jsonl line written as it ends."""

    def expire(signum: int, frame: Any) -> None:
        raise StepTimeout(f"{name} ran past its {limit} s limit")

    print(f"== {name} (limit {limit} s)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    try:
        figures, code = fn(run), 0
    except StepTimeout as err:
        figures, code = {"error": str(err)}, 124
    except Exception as err:  # one step's failure must not cost the others their figures
        traceback.print_exc()
        figures, code = {"error": f"{type(err).__name__}: {err}"}, 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    seconds = time.perf_counter() - t0
    (run.out / f"{name}.json").write_text(
        json.dumps({"step": name, "exit": code, "seconds": seconds, **figures}, indent=2, default=str)
    )
    with open(run.out / "steps.jsonl", "a") as f:
        f.write(json.dumps({"step": name, "exit": code, "seconds": round(seconds, 1)}) + "\n")
    print(f"== {name}: exit {code} in {seconds:.1f} s", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for each step's JSON and steps.jsonl")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from: {', '.join(STEPS)}")
    ap.add_argument("--rehearse", action="store_true", help="tiny sizes on the CPU (the rehearsal)")
    ap.add_argument("--cache-dir", help="where the random-weight model is written (default $TMPDIR/mm-pipeline-bench)")
    ap.add_argument("--peak-gb-s", type=float, default=None, help="the roofline (default: a copy measured here)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every step's time limit")
    args = ap.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        ap.error(f"unknown step(s) {', '.join(unknown)}: choose from {', '.join(STEPS)}")
    run = Run(args)
    limits = dict(zip(STEPS, run.sizes.limits))
    codes = [run_step(run, name, globals()[f"step_{name}"], max(1, round(limits[name] * args.scale))) for name in steps]
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main())
