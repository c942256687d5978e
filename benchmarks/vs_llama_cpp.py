"""Single-stream decode against llama.cpp, same weights, same precision, one process run.

The 187M-parameter Llama shape (random weights, ``archs.build_llama_187m``) is converted to GGUF
(``to_gguf.py``) and decoded by llama.cpp through ``llama-cpp-python`` and by mm-pipeline:
``generate()``, the engine eager (``plain``) and compiled (``fast``), each also with PyTorch's
linear kernels (``decode.matvec=false``). Same prompt ids (random ordinary ids, fixed seed),
greedy, EOS ignored, paths alternated every repetition, medians. Printed: decode tok/s, the
ratio to llama.cpp, GB/s of weights + KV read per token, and the roofline (a copy measured in the
same run). llama.cpp's tokens are reported beside generate()'s (its own kernels round
differently, so on random weights they may part at a near tie).

Optional: without ``llama-cpp-python`` and ``gguf`` installed (``pip install llama-cpp-python
gguf``; llama-cpp-python builds natively, about 8 minutes on 2 cores) it prints a note and exits 0.

    python benchmarks/vs_llama_cpp.py --dtype bfloat16 --reps 3
    python benchmarks/vs_llama_cpp.py --dtype float32 --reps 3
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_vs_generate as dvg  # noqa: E402
from archs import build_arch  # noqa: E402
from to_gguf import convert  # noqa: E402


def llama_cpp_decode(path: Path, ids: list[int], n: int, threads: int) -> tuple[float, list[int]]:
    """llama.cpp's decode tok/s for ``n`` new tokens after ``ids`` ((n - 1) / time after the first)."""
    import llama_cpp

    model = _LLAMAS.get(path) or _LLAMAS.setdefault(
        path,
        llama_cpp.Llama(
            str(path), n_ctx=len(ids) + n + 16, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False
        ),
    )
    model.reset()
    out: list[int] = []
    first = 0.0
    for token in model.generate(ids, top_k=1, temp=0.0, reset=True):
        out.append(token)
        if len(out) == 1:
            first = time.perf_counter()
        if len(out) == n:
            break
    return (n - 1) / (time.perf_counter() - first), out


_LLAMAS: dict = {}


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The options every run against llama.cpp takes (``default_run.py`` too)."""
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "mm-pipeline-bench")


def llama_cpp_missing() -> bool:
    """Whether llama-cpp-python or gguf is missing, said in one line (the benchmark is skipped)."""
    missing = [m for m in ("llama_cpp", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"skipped: {' and '.join(missing)} not installed (pip install llama-cpp-python gguf)", file=sys.stderr)
    return bool(missing)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=55)
    add_common_args(ap)
    args = ap.parse_args(argv)
    if llama_cpp_missing():
        return 0
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model_dir = build_arch("llama-187m", args.cache_dir, "cpu", dtype)
    gguf_path = args.cache_dir / f"llama-187m-{args.dtype}.gguf"
    if not gguf_path.is_file() or gguf_path.stat().st_mtime < (model_dir / "model.safetensors").stat().st_mtime:
        convert(model_dir, gguf_path, "bf16" if dtype == torch.bfloat16 else "f32")

    ns = argparse.Namespace(
        arch=None,
        model=str(model_dir),
        quant="none",
        skip_modules=None,
        dtype=args.dtype,
        prompt_tokens=args.prompt_tokens,
        image=0,
    )
    lm = dvg.load(ns)
    prompt = dvg.Prompt(lm, ns)
    ids = prompt.ids[0].tolist()
    paths = {
        "plain": dvg.make_pipe(lm, False, False),
        "plain-torch": dvg.make_pipe(lm, False, False, matvec=False),
        "fast": dvg.make_pipe(lm, True, False),
        "fast-torch": dvg.make_pipe(lm, True, False, matvec=False),
    }
    for name in ("fast", "fast-torch"):
        paths[name].warmup()
    roofline = dvg.copy_gb_s()
    n = args.new_tokens
    llama_cpp_decode(gguf_path, ids, 4, args.threads)  # untimed: load and first-call costs
    dvg.time_generate(lm, prompt, 2)
    for pipe in paths.values():
        dvg.time_pipeline(pipe, prompt, 2)

    speed: dict[str, list[float]] = {k: [] for k in ["llama.cpp", "generate", *paths]}
    per_token: list[float] = []
    tokens: dict[str, list[int]] = {}
    for rep in range(args.reps):
        order = list(speed) if rep % 2 == 0 else list(reversed(speed))
        for name in order:
            if name == "llama.cpp":
                tok_s, toks = llama_cpp_decode(gguf_path, ids, n, args.threads)
            elif name == "generate":
                t1, _ = dvg.time_generate(lm, prompt, 1)
                tn, toks = dvg.time_generate(lm, prompt, n)
                tok_s = (n - 1) / (tn - t1)
            else:
                m, toks = dvg.time_pipeline(paths[name], prompt, n)
                tok_s, step_bytes = dvg.decode_figures(m, n)
                per_token.append(step_bytes)
            speed[name].append(tok_s)
            tokens.setdefault(name, toks)

    read = statistics.median(per_token)  # bytes a decode step reads: weights + the KV it attends over
    ref = statistics.median(speed["llama.cpp"])
    print(
        f"llama-187m {args.dtype}, {len(ids)}-token prompt, {n} new, {args.threads} threads, {args.reps} reps; "
        f"{read / 1e6:.0f} MB read per token; roofline (copy) {roofline:.1f} GB/s"
    )
    print("| path | decode tok/s | vs llama.cpp | GB/s | % of roofline | tokens = generate |")
    print("|---|---|---|---|---|---|")
    for name, values in speed.items():
        tok_s = statistics.median(values)
        print(
            f"| {name} | {tok_s:.1f} | {tok_s / ref:.2f}x | {read * tok_s / 1e9:.1f} | "
            f"{100 * read * tok_s / 1e9 / roofline:.0f}% | {'yes' if tokens[name] == tokens['generate'] else 'no'} |"
        )
    for model in _LLAMAS.values():
        model.close()  # (its __del__ at interpreter exit raises inside llama-cpp-python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
