"""A new user's first and second run against llama.cpp: issue 52's check of the defaults.

A held-out checkpoint (the 187M-parameter Llama shape, random weights, ``save_pretrained``: on a
CPU ``quant=auto`` loads it in int8wo) is run by the command line with no settings but the model
path, the prompt and the answer's length (EOS ignored), in a fresh Inductor cache folder: the
first run answers eagerly and compiles after its answer (``decode.compile=auto``), the second
starts compiled from the cache, and the third, knowing now what the cached compile's wait costs,
waits for it only if the answer would take longer eagerly. The second run is then repeated (the
cache's record put back as the first run left it), alternating with llama.cpp's Q8_0 of the same
weights, a process each, medians. Printed: each run's decode tok/s, warmup_s,
decode_compiled and wall seconds, the ratio to llama.cpp, and whether the answer's tokens equal
``generate()`` on the same int8wo weights (where they part: how near a tie ``generate()``'s own
top two logits were there, in steps of the dtype's spacing).

Needs ``llama-cpp-python`` and ``gguf`` (``pip install llama-cpp-python gguf``; it builds
natively, about 8 minutes on 2 cores); without them it prints a note and exits 0.

    python benchmarks/default_run.py --reps 3
    python benchmarks/default_run.py --reps 3 --dtype bfloat16   # a bfloat16 checkpoint
    python benchmarks/default_run.py --reps 3 --model DIR        # a Llama checkpoint of your own
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from archs import build_arch  # noqa: E402
from to_gguf import convert  # noqa: E402
from vs_llama_cpp import add_common_args, llama_cpp_missing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Tell me about the sea and the ships on it and the light of the morning"

LLAMA_CPP = """
import sys
sys.path.insert(0, sys.argv[5])
from vs_llama_cpp import _LLAMAS, llama_cpp_decode
ids = [int(t) for t in sys.argv[4].split(",")]
print(llama_cpp_decode(sys.argv[1], ids, int(sys.argv[2]), int(sys.argv[3]))[0])
for model in _LLAMAS.values():
    model.close()
"""  # vs_llama_cpp's timing, in a process of its own


def q8_0(model_dir: Path, out: Path) -> Path:
    """The checkpoint as llama.cpp's Q8_0 (converted to float32 GGUF, then llama.cpp's quantizer)."""
    import llama_cpp

    if out.is_file() and out.stat().st_mtime > (model_dir / "model.safetensors").stat().st_mtime:
        return out
    f32 = convert(model_dir, out.with_suffix(".f32.gguf"), "f32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) != 0:
        raise SystemExit("llama.cpp could not quantize the checkpoint to Q8_0")
    return out


def cli_run(model_dir: Path, n: int, cache: Path, out: Path) -> dict:
    """``python -m pipeline model.path=DIR`` with the defaults; its result.json and wall seconds."""
    command = [sys.executable, "-m", "pipeline", f"model.path={model_dir}", f"prompt={PROMPT}"]
    command += [f"max_new_tokens={n}", "ignore_eos=true", f"hydra.run.dir={out}"]
    env = {k: v for k, v in os.environ.items() if k != "MM_PIPELINE_COMPILE"}  # the default: auto
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the run failed:\n{proc.stderr[-2000:]}")
    result = json.loads((out / "result.json").read_text())
    return {**result, "wall_s": wall}


def llama_cpp_tok_s(gguf: Path, ids: list[int], n: int, threads: int) -> float:
    here = str(Path(__file__).resolve().parent)
    command = [sys.executable, "-c", LLAMA_CPP, str(gguf), str(n), str(threads), ",".join(map(str, ids)), here]
    return float(subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])


def equals_generate(model_dir: Path, result: dict) -> str:
    """Whether the answer's tokens are ``generate()``'s on the weights the run loaded (quant=auto);
    where they part, how near a tie ``generate()``'s logits had there (DESIGN: exact up to true
    near-ties of the top two, which reduction order may flip)."""
    from pipeline import load_model

    lm = load_model(str(model_dir), quant="auto")
    ids = torch.tensor([result["prompt_ids"]])
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=len(result["token_ids"]),
            eos_token_id=None,  # EOS ignored, as the run did (kept, not masked out)
            pad_token_id=lm.tokenizer.pad_token_id or 0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    theirs, ours = out.sequences[0, ids.shape[1] :].tolist(), result["token_ids"]
    at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
    if at is None:
        return "yes"
    logits = out.logits[at][0]
    gap = (logits[theirs[at]] - logits[ours[at]]).item()
    exponent = torch.frexp(logits[theirs[at]].float()).exponent.item()
    step = 2.0 ** (exponent - 1) * torch.finfo(lm.model.dtype).eps  # the model dtype's spacing there
    return (
        f"no: parts at token {at}, where generate()'s best logit leads the run's token by {gap:.3g} "
        f"({gap / step:.3g}x the {str(lm.model.dtype).removeprefix('torch.')} spacing at that size)"
    )


def line(name: str, r: dict) -> str:
    m = r["metrics"]
    return (
        f"| {name} | {m['decode_tok_s']:.1f} | {m.get('warmup_s', 0.0):.1f} | {m['decode_compiled']} | "
        f"{r['wall_s']:.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the checkpoint's dtype")
    ap.add_argument("--model", type=Path, help="a Llama checkpoint of your own (save_pretrained, with its tokenizer)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    if llama_cpp_missing():
        return 0
    model_dir = args.model or build_arch("llama-187m", args.cache_dir, "cpu", getattr(torch, args.dtype))
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    gguf = q8_0(model_dir, args.cache_dir / f"{model_dir.name}-q8_0.gguf")
    n = args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "inductor"  # a user's first time: nothing compiled yet
        first = cli_run(model_dir, n, cache, Path(tmp) / "first")
        record = cache / "mm-pipeline-compiled.json"
        after_first = record.read_bytes()  # each "second run" below starts from it
        second = cli_run(model_dir, n, cache, Path(tmp) / "second")
        third = cli_run(model_dir, n, cache, Path(tmp) / "third")
        ids = first["prompt_ids"]
        ours, theirs = [], []
        for rep in range(args.reps):
            for name in ("ours", "llama.cpp") if rep % 2 == 0 else ("llama.cpp", "ours"):
                if name == "ours":
                    record.write_bytes(after_first)
                    ours.append(cli_run(model_dir, n, cache, Path(tmp) / f"again-{rep}"))
                else:
                    theirs.append(llama_cpp_tok_s(gguf, ids, n, args.threads))
    ref = statistics.median(theirs)
    again = sorted(ours, key=lambda r: r["metrics"]["decode_tok_s"])[len(ours) // 2]
    print(
        f"{model_dir.name}, {first['metrics']['quant']}, {len(ids)}-token prompt, {n} new, "
        f"{args.threads} threads; llama.cpp Q8_0 {ref:.1f} tok/s (median of {args.reps}: "
        f"{', '.join(f'{t:.1f}' for t in theirs)})"
    )
    print("| run | decode tok/s | warmup_s | decode_compiled | wall s |")
    print("|---|---|---|---|---|")
    print(line("first (fresh cache)", first))
    print(line("second", second))
    print(line(f"second, again (median of {args.reps})", again))
    print(line("third (knows the cached compile's wait)", third))
    ratio = again["metrics"]["decode_tok_s"] / ref
    same = first["token_ids"] == second["token_ids"] == again["token_ids"] == third["token_ids"]
    print(
        f"second run vs llama.cpp Q8_0: {ratio:.2f}x; runs' tokens equal: {same}; "
        f"= generate(): {equals_generate(model_dir, second)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
