"""Prefill and decode speed of the pipeline against transformers' ``model.generate()``.

One model is loaded once; each repetition runs, alternating their order so that drifting
clocks and thermals hit both alike, on the same prompt ids and settings (greedy, EOS ignored):

- ``generate``: ``generate(max_new_tokens=1)`` and ``generate(max_new_tokens=N)`` with
  ``eos_token_id=None`` (EOS is kept and generation goes on, exactly what ``ignore_eos`` means
  for the pipeline). TTFT = the first; decode tok/s = (N - 1) / (t_N - t_1).
- ``plain``: the pipeline's default path (the engine, eager step, metrics on; on CUDA the step
  replayed as CUDA graphs, ``decode.cuda_graphs``).
- ``eager`` (``--eager``): ``decode.cuda_graphs=false``, the step's Python run every token (on CPU
  the same as ``plain``).
- ``fast`` (``--fast``): ``decode.compile=true`` (compiled decode steps), warmed up before timing.
- ``plain-torch`` / ``fast-torch`` (``--torch-kernels``): the same with ``decode.matvec=false``,
  PyTorch's own linear kernels instead of the native one-row kernel (CPU).

Pipeline figures are measured the same way as generate's: TTFT = request start to the first
token chosen; decode tok/s = (N - 1) / (end - first token), sampling and bookkeeping included.
Every repetition starts from an empty prefix cache (the image encoded, the whole prompt
prefilled). Printed: medians, ratios against generate, ``bandwidth_gb_s`` ((decode weight bytes
+ the KV bytes each step reads) x decode tok/s) as a percentage of the roofline (a copy measured
in the same run, or ``--peak-gb-s``) and whether every path produced the same tokens.

    python benchmarks/decode_vs_generate.py                         # embedded tiny model, CPU
    python benchmarks/decode_vs_generate.py --fast --reps 5
    python benchmarks/decode_vs_generate.py --arch qwen2-vl-2b --quant nf4 --fast --image 448 \\
        --prompt-tokens 32 --new-tokens 256                         # real-size, random weights (GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipeline import Pipeline, Request, load_model  # noqa: E402
from pipeline.model.loading import LoadedModel  # noqa: E402
from pipeline.metrics import decode_weight_bytes, synchronize  # noqa: E402
from stages import DecodeLoop, Prefill, Tokenize  # noqa: E402

from archs import ARCHS, build_arch  # noqa: E402


def load(args: argparse.Namespace) -> LoadedModel:
    if args.arch:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        cache = Path(args.cache_dir or Path(tempfile.gettempdir()) / "mm-pipeline-bench")
        dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.bfloat16
        path = str(build_arch(args.arch, cache, device, dtype))
    elif args.model:
        path = args.model
    else:
        from pipeline.tiny import default_model_dir

        path = str(default_model_dir())
    quant = (
        args.quant
        if args.skip_modules is None
        else {"name": args.quant, "skip_modules": [n for n in args.skip_modules.split(",") if n]}
    )
    return load_model(path, dtype=args.dtype, quant=quant)


# --- one request ----------------------------------------------------------------------------


class Prompt:
    """The same prompt for every path: raw ids (text) or a templated image request."""

    def __init__(self, lm: LoadedModel, args: argparse.Namespace) -> None:
        self.lm = lm
        self.image = None
        if args.image:
            import numpy as np
            from PIL import Image

            rng = np.random.default_rng(0)
            self.image = Image.fromarray(rng.integers(0, 256, (args.image, args.image, 3), dtype=np.uint8), "RGB")
            words = ("describe the picture in detail please " * 64).split()
            text = " ".join(words)
            n = len(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
            while n > args.prompt_tokens and len(words) > 1:
                words = words[:-1]
                n = len(lm.tokenizer(" ".join(words), add_special_tokens=False)["input_ids"])
            self.text = " ".join(words)
            pipe = Pipeline(lm, {"tokenize": Tokenize()})
            ctx = pipe.tokenize(self.request(1))
            self.ids = ctx.input_ids
            self.model_inputs = {k: v for k, v in ctx.model_inputs.items() if isinstance(v, torch.Tensor)}
        else:
            # Random ordinary-vocabulary ids (no special tokens), fixed seed, like llama-bench.
            special = set(lm.tokenizer.all_special_ids) | set(lm.tokenizer.get_added_vocab().values())
            pool = torch.tensor([i for i in range(len(lm.tokenizer)) if i not in special])
            g = torch.Generator().manual_seed(0)
            self.ids = pool[torch.randint(len(pool), (1, args.prompt_tokens), generator=g)].to(lm.device)
            self.model_inputs = {}

    def request(self, n: int) -> Request:
        images = [self.image] if self.image is not None else []
        return Request(prompt=getattr(self, "text", None), images=images, max_new_tokens=n, ignore_eos=True)

    @property
    def length(self) -> int:
        return int(self.ids.shape[1])


def time_generate(lm: LoadedModel, prompt: Prompt, n: int) -> tuple[float, list[int]]:
    kwargs = {k: v.to(lm.device) for k, v in prompt.model_inputs.items()}
    synchronize(lm.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=prompt.ids,
            attention_mask=torch.ones_like(prompt.ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=lm.tokenizer.pad_token_id or 0,
            **kwargs,
        )
    synchronize(lm.device)
    return time.perf_counter() - t0, out[0, prompt.length :].tolist()


def time_pipeline(pipe: Pipeline, prompt: Prompt, n: int) -> tuple[dict, list[int]]:
    """One request, metrics on: through every stage for an image prompt, else from raw ids. The
    prefix cache is emptied first, so every repetition encodes its image and prefills its whole
    prompt, as generate() does (a cached prompt would time a lookup)."""
    pipe.pool.clear_prefix_cache()
    if prompt.image is not None:
        result = pipe.run(prompt.request(n))
        return result.metrics, result.token_ids
    ctx = pipe.run_ids(prompt.ids[0].tolist(), prompt.request(n))
    ctx.cache.clear()
    return pipe.result(ctx).metrics, list(ctx.generated)


def decode_figures(metrics: dict, n: int) -> tuple[float, float]:
    """(decode tok/s, bytes one decode step reads) of a pipeline request of ``n`` new tokens: the
    speed measured as generate()'s is, (n - 1) / (end - first token); the bytes are the decode
    weights plus the keys and values each step attends over."""
    return (n - 1) / (metrics["total_s"] - metrics["ttft_s"]), metrics["bandwidth_gb_s"] * 1e9 / metrics["decode_tok_s"]


def make_pipe(
    lm: LoadedModel, fast: bool, image: bool, matvec: bool = True, cuda_graphs: bool = True, **settings: object
) -> Pipeline:
    """The chain a path times: ``fast`` compiles the decode step; ``settings`` go to ``Pipeline``
    (e.g. ``kv_attention``)."""
    stages: dict[str, Callable] = {}
    if image:
        from stages import VisionEncoder

        stages = {"tokenize": Tokenize(), "vision_encoder": VisionEncoder()}
    stages["prefill"] = Prefill()
    stages["decode"] = DecodeLoop(compile=fast, matvec=matvec, cuda_graphs=cuda_graphs)
    return Pipeline(lm, stages, **settings)


def copy_gb_s(mib: int = 256, reps: int = 10) -> float:
    """The roofline: a STREAM-like copy of ``mib`` MiB (bytes read + bytes written per second,
    median of ``reps``), on the model's device, measured in this run."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.ones(mib * 2**20 // 4, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 1):
        synchronize(a.device)
        t0 = time.perf_counter()
        b.copy_(a)
        synchronize(a.device)
        times.append(time.perf_counter() - t0)
    return 2 * a.numel() * 4 / statistics.median(times[1:]) / 1e9


def measure(
    lm: LoadedModel, prompt: Prompt, paths: dict[str, Pipeline], n: int, reps: int, peak_gb_s: float | None
) -> list[dict]:
    """Every path and ``generate()`` on ``prompt`` (``n`` new tokens), alternated over ``reps``
    repetitions after one untimed round; one row of medians per path, ratios against generate."""
    # One untimed round of everything: allocator, kernels and lazy imports warmed alike.
    time_generate(lm, prompt, 2)
    for pipe in paths.values():
        time_pipeline(pipe, prompt, 2)

    samples: dict[str, dict[str, list[float]]] = {
        k: {"ttft_s": [], "decode_tok_s": [], "bytes_per_token": []} for k in ["generate", *paths]
    }
    tokens: dict[str, list[int]] = {}
    for rep in range(reps):
        order = ["generate", *paths] if rep % 2 == 0 else [*paths, "generate"]
        for name in order:
            if name == "generate":
                t1, _ = time_generate(lm, prompt, 1)
                tn, toks = time_generate(lm, prompt, n)
                samples[name]["ttft_s"].append(t1)
                samples[name]["decode_tok_s"].append((n - 1) / (tn - t1))
            else:
                m, toks = time_pipeline(paths[name], prompt, n)
                samples[name]["ttft_s"].append(m["ttft_s"])
                tok_s, per_token = decode_figures(m, n)
                samples[name]["decode_tok_s"].append(tok_s)
                samples[name]["bytes_per_token"].append(per_token)
            tokens.setdefault(name, toks)
            if toks != tokens[name]:
                print(f"warning: {name} gave different tokens across repetitions", file=sys.stderr)

    # generate() grows a dynamic cache exactly like the pipeline's paths: same bytes per step.
    samples["generate"]["bytes_per_token"] = samples[next(iter(paths))]["bytes_per_token"]
    rows = []
    base = {k: statistics.median(v) for k, v in samples["generate"].items() if v}
    for name, figs in samples.items():
        ttft = statistics.median(figs["ttft_s"])
        tok_s = statistics.median(figs["decode_tok_s"])
        bw = statistics.median(figs["bytes_per_token"]) * tok_s / 1e9
        rows.append(
            {
                "path": name,
                "ttft_s": ttft,
                "prefill_tok_s": prompt.length / ttft,
                "decode_tok_s": tok_s,
                "decode_tok_s_stdev": statistics.stdev(figs["decode_tok_s"]) if len(figs["decode_tok_s"]) > 1 else 0.0,
                "prefill_ratio": base["ttft_s"] / ttft,
                "decode_ratio": tok_s / base["decode_tok_s"],
                "bandwidth_gb_s": bw,
                "roofline_pct": 100 * bw / peak_gb_s if peak_gb_s else None,
                "tokens_match_generate": tokens[name] == tokens["generate"],
            }
        )
    return rows


def print_rows(rows: list[dict], peak_gb_s: float | None) -> None:
    """``measure``'s rows as a Markdown table on stdout."""
    print(
        f"\n| path | prefill tok/s (P/TTFT) | decode tok/s | vs generate: prefill | decode | bandwidth GB/s |"
        f"{' roofline % |' if peak_gb_s else ''} tokens = generate |"
    )
    print(f"|---|---|---|---|---|---|{'---|' if peak_gb_s else ''}---|")
    for r in rows:
        roof = f" {r['roofline_pct']:.1f} |" if peak_gb_s else ""
        print(
            f"| {r['path']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} ± {r['decode_tok_s_stdev']:.2f} | "
            f"{r['prefill_ratio']:.3f} | {r['decode_ratio']:.3f} | {r['bandwidth_gb_s']:.3f} |{roof} "
            f"{'yes' if r['tokens_match_generate'] else 'NO'} |"
        )


# --- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a save_pretrained directory (default: the embedded tiny model)")
    ap.add_argument("--arch", choices=ARCHS, help="build this architecture with random weights instead")
    ap.add_argument("--cache-dir", help="where --arch models are written (default: $TMPDIR/mm-pipeline-bench)")
    ap.add_argument("--quant", default="none", help="nf4 | fp4 | int8 | int8wo | int4wo | none")
    ap.add_argument("--dtype", default="auto", help="auto (float32 CPU, bfloat16 GPU) | bfloat16 | float32")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--image", type=int, default=0, help="add one random SIZE x SIZE image (e.g. 448)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-modules", help="quant.skip_modules, comma-separated ('' quantises lm_head too)")
    ap.add_argument("--fast", action="store_true", help="also time decode.compile=true")
    ap.add_argument("--eager", action="store_true", help="also time decode.cuda_graphs=false (CUDA)")
    ap.add_argument(
        "--torch-kernels",
        action="store_true",
        help="also time each path with decode.matvec=false (PyTorch's linear kernels, no native kernel)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument(
        "--peak-gb-s",
        type=float,
        default=None,
        help="memory bandwidth to report a roofline %% against (default: a copy measured in this run)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.new_tokens
    if n < 2:
        ap.error("--new-tokens must be >= 2 (decode speed needs a decode step)")

    lm = load(args)
    prompt = Prompt(lm, args)
    image = prompt.image is not None
    paths: dict[str, Pipeline] = {"plain": make_pipe(lm, False, image)}
    if args.eager:
        paths["eager"] = make_pipe(lm, False, image, cuda_graphs=False)
    if args.torch_kernels:
        paths["plain-torch"] = make_pipe(lm, False, image, matvec=False)
    warmup_s = None
    if args.fast:
        paths["fast"] = make_pipe(lm, True, image)
        warmup_s = paths["fast"].warmup()
        if args.torch_kernels:
            paths["fast-torch"] = make_pipe(lm, True, image, matvec=False)
            warmup_s += paths["fast-torch"].warmup()
    if args.peak_gb_s is None:
        args.peak_gb_s = copy_gb_s()
    read_bytes = decode_weight_bytes(lm.model, lm.family.encoder_modules)
    print(
        f"model {lm.path}  quant={lm.quant} dtype={lm.model.dtype} device={lm.device}  "
        f"decode weights {read_bytes / 1e6:.1f} MB  prompt {prompt.length} tokens"
        f"{' (with a %dx%d image)' % (args.image, args.image) if image else ''}  new {n}  reps {args.reps}"
        + (f"  warm-up {warmup_s:.1f} s" if warmup_s is not None else "")
        + f"  roofline {args.peak_gb_s:.1f} GB/s",
        file=sys.stderr,
    )

    rows = measure(lm, prompt, paths, n, args.reps, args.peak_gb_s)
    print_rows(rows, args.peak_gb_s)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "warmup_s": warmup_s, "rows": rows}, indent=2))
    mismatched = [r["path"] for r in rows if not r["tokens_match_generate"]]
    if mismatched:
        print(f"tokens differ from generate() for: {', '.join(mismatched)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
