"""Single-stream decode speed of each weight scheme on this device, one process run: the figures
behind ``quant=auto`` and the scheme table in docs/quantisation.md.

The 187M-parameter Llama shape (random weights, ``archs.build_llama_187m``) is loaded once per
scheme; each is timed on the same prompt ids (greedy, EOS ignored), schemes alternated every
repetition, medians. Per scheme: compiled decode tok/s (``decode.compile=true``; ``--eager``: the
plain engine), the ratio to the unquantised model, the bytes a step reads, GB/s, and whether the
engine's tokens equal ``generate()`` on the same quantised weights.

    python benchmarks/quant_speed.py --dtype bfloat16 --schemes none,int8wo-keephead,int8wo --reps 3
    python benchmarks/quant_speed.py --dtype bfloat16 --schemes none,nf4,int4wo   # on a GPU

``int8wo-keephead`` is int8wo with ``quant.skip_modules=[lm_head]``: the output projection kept in
model.dtype (transformers' default; int8wo's own quantises it too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_vs_generate as dvg  # noqa: E402
from archs import build_arch  # noqa: E402


def load(model_dir: Path, scheme: str, dtype: str):
    """``scheme`` a quant name, or ``NAME-keephead``: that scheme with ``quant.skip_modules=[lm_head]``."""
    name, _, suffix = scheme.partition("-")
    if suffix not in ("", "keephead"):
        raise SystemExit(f"unknown scheme {scheme!r}: a quant name, optionally with -keephead")
    ns = argparse.Namespace(
        arch=None,
        model=str(model_dir),
        quant=name,
        dtype=dtype,
        prompt_tokens=0,
        image=0,
        skip_modules="lm_head" if suffix else None,
    )
    return dvg.load(ns)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument(
        "--schemes",
        default="none,int8wo-keephead,int8wo",
        help="comma-separated quant names (-keephead: lm_head kept in model.dtype)",
    )
    ap.add_argument("--prompt-tokens", type=int, default=55)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="time the plain engine instead of decode.compile=true")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "mm-pipeline-bench")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = build_arch("llama-187m", args.cache_dir, device, getattr(torch, args.dtype))
    schemes = [s for s in args.schemes.split(",") if s]
    runs = {}
    for scheme in schemes:
        lm = load(model_dir, scheme, args.dtype)
        prompt = dvg.Prompt(lm, argparse.Namespace(prompt_tokens=args.prompt_tokens, image=0))
        pipe = dvg.make_pipe(lm, not args.eager, False)
        if not args.eager:
            pipe.warmup()
        dvg.time_pipeline(pipe, prompt, 2)
        _, expected = dvg.time_generate(lm, prompt, args.new_tokens)
        runs[scheme] = (lm, prompt, pipe, expected)
    roofline = dvg.copy_gb_s()
    speed: dict[str, list[float]] = {s: [] for s in schemes}
    read: dict[str, list[float]] = {s: [] for s in schemes}
    same: dict[str, bool] = {}
    n = args.new_tokens
    for rep in range(args.reps):
        for scheme in schemes if rep % 2 == 0 else reversed(schemes):
            lm, prompt, pipe, expected = runs[scheme]
            m, tokens = dvg.time_pipeline(pipe, prompt, n)
            tok_s, per_token = dvg.decode_figures(m, n)
            speed[scheme].append(tok_s)
            read[scheme].append(per_token)
            same.setdefault(scheme, tokens == expected)
    base = statistics.median(speed[schemes[0]])
    print(
        f"llama-187m {args.dtype} on {device}, {'plain' if args.eager else 'compiled'} decode, {n} new tokens, "
        f"{args.reps} reps; roofline (copy) {roofline:.1f} GB/s"
    )
    print(
        f"| scheme | MB read per token | decode tok/s | vs {schemes[0]} | GB/s | tokens = generate() (same weights) |"
    )
    print("|---|---|---|---|---|---|")
    for scheme in schemes:
        tok_s, per_token = statistics.median(speed[scheme]), statistics.median(read[scheme])
        print(
            f"| {scheme} | {per_token / 1e6:.0f} | {tok_s:.1f} | {tok_s / base:.2f}x | {per_token * tok_s / 1e9:.1f} | "
            f"{'yes' if same[scheme] else 'no'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
