"""What serving LoRA adapters costs: R requests spread over A adapters against the same R requests
on the base model alone, in one process run.

The workload (issue 51's): R requests (default 64) of random ordinary-vocabulary prompts of 20-90
tokens (``engine_throughput.workload``), G generated tokens each (default 32), greedy, EOS ignored,
all submitted at once. Arms, alternating in each repetition:

- ``base``: every request on the base model;
- ``adapters``: request i names adapter i % A (default 8 adapters, made with peft on the model:
  rank ``--rank``, targets ``--targets``, random non-zero factors), so every step holds rows of
  several adapters;
- ``one adapter`` (with ``--one``): every request names the same adapter (the single-adapter path).

The figure is the adapters arm's wall time over the base arm's in the same repetition (the issue
asks at most 1.3x on CPU); the median over repetitions is reported, and each adapter's bytes
(its factors, float32 as peft keeps them) and the stacked copy mixed steps read.

    python benchmarks/lora_throughput.py                                   # 187M Llama shape, CPU, quant=auto
    python benchmarks/lora_throughput.py --targets all-linear --rank 8 --reps 3
    python benchmarks/lora_throughput.py --model DIR --quant none              # e.g. a tiny model: host work
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipeline import Pipeline, Request, load_model  # noqa: E402
from pipeline.runner.lora import stack  # noqa: E402
from pipeline.testing.lora import make_adapter  # noqa: E402
from stages import DecodeLoop, Prefill  # noqa: E402

from archs import ARCHS, build_arch  # noqa: E402
from engine_throughput import workload, workload_args  # noqa: E402


def adapters_for(base: Path, root: Path, args: argparse.Namespace) -> list[Path]:
    """``args.adapters`` peft adapters on the model at ``base`` (made once per setting)."""
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    out = []
    for i in range(args.adapters):
        folder = root / f"lora-{base.name}-r{args.rank}-{args.targets.replace(',', '+')}-{i}"
        if not (folder / "adapter_config.json").is_file():
            make_adapter(base, folder, seed=100 + i, targets=targets, r=args.rank, alpha=2 * args.rank)
        out.append(folder)
    return out


def run_arm(pipe: Pipeline, prompts: list[list[int]], gen: int, names: list[str | None]) -> float:
    """Wall seconds for every prompt submitted at once, prompt i with adapter ``names[i]``."""
    pipe.pool.clear_prefix_cache()
    t0 = time.perf_counter()
    handles = [
        pipe.submit(Request(max_new_tokens=gen, ignore_eos=True, adapter=name), ids=p, result=False)
        for p, name in zip(prompts, names)
    ]
    ctxs = [pipe.wait(h) for h in handles]
    seconds = time.perf_counter() - t0
    if any(len(c.generated) != gen for c in ctxs):
        raise RuntimeError("a request stopped early")
    for c in ctxs:
        c.cache.clear()
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=ARCHS, default="llama-187m", help="the model's shape (random weights)")
    ap.add_argument("--model", help="a save_pretrained folder instead (e.g. a tiny model: host work shows most)")
    ap.add_argument("--quant", default="auto", help="weight scheme (auto: what a user gets: int8wo on CPU)")
    workload_args(ap)
    ap.set_defaults(new_tokens=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,v_proj", help="comma-separated module names, or all-linear")
    ap.add_argument("--max-seqs", type=int, default=0, help="engine.max_seqs (0: the default, 8 on CPU)")
    ap.add_argument("--one", action="store_true", help="also time every request on one adapter")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "mm-pipeline-bench"))
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)

    root = Path(args.cache)
    base = Path(args.model) if args.model else build_arch(args.arch, root, "cpu", torch.float32)
    folders = adapters_for(base, root, args)
    lm = load_model(str(base), quant=args.quant)
    for i, folder in enumerate(folders):
        lm.load_adapter(f"a{i}", str(folder))
    engine = {"max_seqs": args.max_seqs} if args.max_seqs else {}
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, **engine)
    prompts = workload(lm, args)
    arms = {"base": [None] * len(prompts), "adapters": [f"a{i % args.adapters}" for i in range(len(prompts))]}
    if args.one:
        arms["one adapter"] = ["a0"] * len(prompts)
    for names in arms.values():  # warm-up: the native kernels, the stacks, each arm's first steps
        run_arm(pipe, prompts[:8], 4, names[:8])
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for rep in range(args.reps):
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))
        for arm in order:
            times[arm].append(run_arm(pipe, prompts, args.new_tokens, arms[arm]))
            print(f"rep {rep + 1} {arm}: {times[arm][-1]:.2f} s", file=sys.stderr)
    report(lm, pipe, args, times)
    return 0


def report(lm, pipe: Pipeline, args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    adapters = lm.adapters.loaded()
    stacked = stack(adapters)
    stacked_bytes = sum(t.numel() * t.element_size() for s in stacked.layers.values() for t in (s.a, s.b))
    tokens = args.requests * args.new_tokens
    base = statistics.median(times["base"])
    ratios = [a / b for a, b in zip(times["adapters"], times["base"])]
    print(
        f"\n{args.model or args.arch}, quant={lm.quant}, {args.requests} requests x {args.new_tokens} tokens, "
        f"engine.max_seqs={pipe.max_seqs}, {args.adapters} adapters of rank {args.rank} on {args.targets}"
    )
    print("| arm | wall s (median) | tokens/s | vs base |")
    print("|---|---|---|---|")
    for arm, values in times.items():
        wall = statistics.median(values)
        print(f"| {arm} | {wall:.2f} | {tokens / wall:.1f} | {wall / base:.2f}x |")
    per, mib = adapters[0].nbytes, 2**20
    listed = ", ".join(f"{r:.3f}" for r in ratios)
    print(f"adapters / base per repetition: {listed} (median {statistics.median(ratios):.3f})")
    print(
        f"memory: {per / mib:.2f} MiB per adapter (float32 factors) + {stacked_bytes / len(adapters) / mib:.2f} MiB "
        f"each in the stacked copy mixed steps read; the base weights {lm.weights_bytes / mib:.1f} MiB"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "times": times, "ratios": ratios, "adapter_bytes": per}, indent=2) + "\n"
        )


if __name__ == "__main__":
    sys.exit(main())
