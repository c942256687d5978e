"""Aggregate throughput of the engine against the same requests one at a time and against
transformers' own continuous batching (``model.generate_batch``), in one process run.

The workload (the issue's): R requests (default 64) of random ordinary-vocabulary prompts of
20-90 tokens, each generating G tokens (default 48) greedily with EOS ignored. Each repetition
runs, in alternating order:

- ``one at a time``: the pipeline with ``engine.max_seqs=1``, requests run one after another
  (the behaviour of 0.1, through the same engine code);
- ``engine``: the pipeline with ``engine.max_seqs=R`` (or each of ``--max-seqs 1,16,64``),
  every request submitted at once;
- ``generate_batch``: ``model.generate_batch`` on the same ids, its paged cache sized for the
  workload (``--hf-blocks`` blocks of ``--hf-page`` tokens) instead of its default, which
  reserves most of the machine's memory.

Throughput = generated tokens / wall seconds; ratios are against ``one at a time`` and
``generate_batch`` measured in the same repetition. Tokens: every request's engine tokens are
compared with its one-at-a-time tokens (in float32 a difference may only start at a near-tie of
the top two logits; the script reports how many sequences are identical).

With ``--shared-prefix N`` every request starts with the same N-token system prompt: the report
then shows the KV pool's peak blocks against what contiguous per-sequence caches would hold.

    python benchmarks/engine_throughput.py                      # tiny text model, CPU
    python benchmarks/engine_throughput.py --reps 3 --compile
    python benchmarks/engine_throughput.py --shared-prefix 200 --skip-hf
    python benchmarks/engine_throughput.py --arch qwen2-vl-2b --dtype bfloat16 --requests 256 \
        --new-tokens 128 --max-seqs 1,16,64,128 --skip-solo --skip-hf          # GPU, random weights
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
from pipeline.model.loading import LoadedModel  # noqa: E402
from pipeline.memory import kv_bytes  # noqa: E402
from pipeline.runner import detach  # noqa: E402

from archs import ARCHS, build_arch  # noqa: E402
from stages import DecodeLoop, Prefill  # noqa: E402


def workload(lm: LoadedModel, args: argparse.Namespace) -> list[list[int]]:
    """Random ordinary-vocabulary prompts (fixed seed), 20-90 tokens, optional shared prefix."""
    special = set(lm.tokenizer.all_special_ids) | set(lm.tokenizer.get_added_vocab().values())
    vocab = torch.tensor([i for i in range(len(lm.tokenizer)) if i not in special])
    g = torch.Generator().manual_seed(args.seed)
    prefix = vocab[torch.randint(len(vocab), (args.shared_prefix,), generator=g)].tolist()
    out = []
    for _ in range(args.requests):
        n = int(torch.randint(args.min_prompt, args.max_prompt + 1, (1,), generator=g))
        out.append(prefix + vocab[torch.randint(len(vocab), (n,), generator=g)].tolist())
    return out


def workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload's arguments (``workload`` reads them), shared by the scripts that time it."""
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=20)
    ap.add_argument("--max-prompt", type=int, default=90)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens of a system prompt every request starts with")
    ap.add_argument("--seed", type=int, default=0)


def pipeline(lm: LoadedModel, max_seqs: int, compile: bool) -> Pipeline:
    return Pipeline(
        lm, {"prefill": Prefill(), "decode": DecodeLoop(compile=compile)}, max_seqs=max_seqs, max_batch_tokens=2048
    )


def run_engine(
    pipe: Pipeline, prompts: list[list[int]], gen: int, at_once: bool
) -> tuple[float, list[list[int]], dict]:
    """Wall seconds, tokens per request, engine figures (peak blocks)."""
    pipe.pool.clear_prefix_cache()
    engine = pipe.engine
    engine.counters["kv_blocks_peak"] = 0
    t0 = time.perf_counter()
    if at_once:
        handles = [pipe.submit(Request(max_new_tokens=gen, ignore_eos=True), ids=p, result=False) for p in prompts]
        ctxs = [pipe.wait(h) for h in handles]
    else:
        ctxs = [pipe.run_ids(p, Request(max_new_tokens=gen, ignore_eos=True)) for p in prompts]
    seconds = time.perf_counter() - t0
    tokens = [list(c.generated) for c in ctxs]
    for c in ctxs:
        c.cache.clear()
    return seconds, tokens, dict(engine.counters)


def run_generate_batch(
    lm: LoadedModel, prompts: list[list[int]], gen: int, args: argparse.Namespace
) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=gen, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=args.hf_blocks, page_size=args.hf_page, max_batch_tokens=2048)
    detach(lm.model)  # generate_batch accepts only transformers' own attention implementations
    t0 = time.perf_counter()  # (not under inference_mode: its worker thread updates tensors in place)
    out = lm.model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb, progress_bar=False)
    seconds = time.perf_counter() - t0
    by_prompt = {tuple(o.prompt_ids): list(o.generated_tokens) for o in out.values()}
    tokens = [by_prompt.get(tuple(p), [])[:gen] for p in prompts]
    if any(len(t) != gen for t in tokens):
        raise RuntimeError("generate_batch dropped requests or stopped early (see its log above)")
    return seconds, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a save_pretrained directory (default: the project's tiny Qwen3 text model)")
    ap.add_argument("--arch", choices=ARCHS, help="build this architecture with random weights instead")
    ap.add_argument("--dtype", default="auto", help="auto (float32 CPU, bfloat16 GPU) | bfloat16 | float32")
    ap.add_argument("--quant", default="none", help="weight scheme: none | int8wo | nf4 | ... (quant=...)")
    workload_args(ap)
    ap.add_argument(
        "--max-seqs", default="0", help="engine.max_seqs of the batched run(s), e.g. 1,16,64 (0: all requests)"
    )
    ap.add_argument("--compile", action="store_true", help="decode.compile=true for both pipeline paths (warmed up)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true", help="leave generate_batch out")
    ap.add_argument("--skip-solo", action="store_true", help="leave the one-at-a-time run out")
    ap.add_argument("--hf-blocks", type=int, default=0, help="generate_batch cache blocks (0: sized for the workload)")
    ap.add_argument("--hf-page", type=int, default=256, help="generate_batch tokens per block")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)

    if args.arch:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.bfloat16
        args.model = str(build_arch(args.arch, Path(tempfile.gettempdir()) / "mm-pipeline-bench", device, dtype))
    elif args.model is None:
        from pipeline.testing import build_tiny

        args.model = str(build_tiny("qwen3", Path(tempfile.gettempdir()) / "mm-pipeline-bench" / "tiny-qwen3"))
    lm = load_model(args.model, dtype=args.dtype, quant=args.quant)
    prompts = workload(lm, args)
    gen = args.new_tokens
    longest = max(len(p) for p in prompts) + gen
    if not args.hf_blocks:
        args.hf_blocks = args.requests * -(-longest // args.hf_page) + 8
    sizes = [int(v) or args.requests for v in str(args.max_seqs).split(",")]
    paths = {("engine" if len(sizes) == 1 else f"engine max_seqs={m}"): pipeline(lm, m, args.compile) for m in sizes}
    if not args.skip_solo:
        paths["one at a time"] = pipeline(lm, 1, args.compile)
    warmup = {name: p.warmup() for name, p in paths.items()} if args.compile else {}
    generated = args.requests * gen
    print(
        f"model {lm.path}  {args.requests} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens, {gen} generated each  reps {args.reps}" + (f"  warm-up {warmup}" if warmup else ""),
        file=sys.stderr,
    )

    # One untimed round of each path: allocator, lazy imports.
    for name, pipe in paths.items():
        run_engine(pipe, prompts[:4], 4, at_once=name.startswith("engine"))
    if not args.skip_hf:
        run_generate_batch(lm, prompts[:4], 4, args)

    seconds: dict[str, list[float]] = {name: [] for name in [*paths, *([] if args.skip_hf else ["generate_batch"])]}
    tokens: dict[str, list[list[int]]] = {}
    peak_blocks = 0
    order = list(seconds)
    for rep in range(args.reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            if name == "generate_batch":
                s, toks = run_generate_batch(lm, prompts, gen, args)
            else:
                s, toks, counters = run_engine(paths[name], prompts, gen, at_once=name.startswith("engine"))
                if name.startswith("engine"):
                    peak_blocks = max(peak_blocks, counters.get("kv_blocks_peak", 0))
            seconds[name].append(s)
            tokens.setdefault(name, toks)

    rows = []
    med = {name: statistics.median(v) for name, v in seconds.items()}
    first = next(iter(med))
    reference = tokens.get("one at a time")
    for name, s in med.items():
        row = {
            "path": name,
            "seconds": s,
            "throughput_tok_s": generated / s,
            "vs_first": med[first] / s,
            "vs_one_at_a_time": med["one at a time"] / s if "one at a time" in med else None,
            "vs_generate_batch": med["generate_batch"] / s if "generate_batch" in med else None,
        }
        if reference is not None:
            row["identical_to_one_at_a_time"] = sum(a == b for a, b in zip(tokens[name], reference))
        rows.append(row)
    print(
        f"\n| path | wall s | tokens/s | vs {first} | vs one at a time | vs generate_batch | "
        "sequences identical to one at a time |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        vs = [f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("vs_first", "vs_one_at_a_time", "vs_generate_batch")]
        same = f"{r['identical_to_one_at_a_time']}/{args.requests}" if "identical_to_one_at_a_time" in r else "-"
        print(
            f"| {r['path']} | {r['seconds']:.2f} | {r['throughput_tok_s']:.1f} | {vs[0]} | {vs[1]} | {vs[2]} | {same} |"
        )

    pool = next(iter(paths.values())).pool
    contiguous = sum(kv_bytes(lm.config, len(p) + gen - 1, lm.model.dtype) for p in prompts)
    paged = peak_blocks * pool.block_bytes
    print(
        f"\nKV: peak {peak_blocks} blocks of {pool.block_size} = {paged / 2**20:.2f} MiB in the pool "
        f"({paged / args.requests / 1024:.1f} KiB per sequence) vs {contiguous / 2**20:.2f} MiB for "
        f"{args.requests} contiguous caches ({contiguous / args.requests / 1024:.1f} KiB per sequence): "
        f"{paged / contiguous:.2f}x"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "rows": rows,
                    "kv_peak_blocks": peak_blocks,
                    "kv_paged_bytes": paged,
                    "kv_contiguous_bytes": contiguous,
                    "prompts": prompts,
                    "tokens": tokens[first],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
