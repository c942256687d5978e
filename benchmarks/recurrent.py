"""What recurrent-state checkpoints cost and buy on a Qwen3.5-style hybrid model, in one run.

Why: a Gated DeltaNet layer keeps one state per sequence instead of keys and values per
position, and a state cannot be cropped. Going back in time (a rollback, ``/undo``, a snapshot,
a prefix shared with an earlier request) therefore lands on the nearest **checkpoint** at or
before the position asked for, and the next prefill recomputes the rest. Checkpoints are taken
every ``kv.state_checkpoint_every`` tokens (E), at each prompt's end and its last block
boundary; each costs one state's bytes. This script measures that trade for several E, "off"
meaning E larger than any context (only the prompt-end checkpoints exist):

1. **Rollback into a long context.** A context of L tokens is prefilled into a cache (its TTFT,
   as a ratio to "off", is what taking the checkpoints costs the prefill); then, R times, a fork
   of that cache rolls back to a seeded random position p and a short new suffix follows (the
   prefix cache emptied first, so only the cache's own checkpoints count).
   Recomputed tokens = the follow-up's ``prefill_tokens`` minus its suffix (= p minus the
   checkpoint reached); the follow-up's TTFT as a ratio to the smallest E; and the bytes the
   cache holds after the context: KV blocks vs recurrent states (``cache.nbytes``).
2. **Prefix reuse across requests.** A request shares its first L' tokens with an earlier,
   released one (``branch``: the second request leaves the first's prompt at L', not at a block
   boundary; ``extend``: the second is the first's prompt + answer + a new turn, as a chat
   without a kept cache): ``kv_reused_tokens`` for each E, and its TTFT as a ratio to the same
   request with an empty prefix cache (``cold``), same pipeline.
3. **Decode.** One stream: the pipeline's decode tok/s against ``model.generate()`` (alternating,
   same prompt ids); and B requests (default 8) submitted together to the engine against the
   same requests one at a time (aggregate generated tokens / wall seconds).

The model: a Qwen3.5-shaped text model (``Qwen3_5ForCausalLM``) with random weights, built once
into ``$TMPDIR/mm-pipeline-bench`` with Qwen3.5's proportions scaled to ``--hidden`` (layers
3 linear : 1 full attention as transformers' ``full_attention_interval`` default, linear heads
of 128, one linear head per 64 of hidden, full-attention heads of 256 with 2 KV heads) and the
tiny Qwen3.5 tokenizer (small vocabulary, so the lm_head does not dominate). float32 on CPU.

Every answer is compared with ``model.generate(do_sample=False)`` on the same ids (EOS ignored);
the script exits 1 if any token differs. All timings are ratios within the run: the machine's
absolute speed drifts. One torch thread by default (``--threads``): on a shared 2-core machine,
two OpenMP threads stalled 5-20x whenever another process took a core (the reference delta
rule's many small ops each end in a barrier), which no number of repetitions averages away; one
thread was steady (benchmarks/README.md).

    python benchmarks/recurrent.py                   # L=2048, E = 64,256,1024,off (about 9 min, 1 CPU thread)
    python benchmarks/recurrent.py --quick           # a small smoke (about 10 s)
    python benchmarks/recurrent.py --every 16,32,64,off --context 1024 --parts rollback,prefix
    python benchmarks/recurrent.py --hidden 1024 --layers 8 --json recurrent.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipeline import KVCache, Pipeline, Request, load_model  # noqa: E402
from pipeline.model.loading import LoadedModel  # noqa: E402
from stages import DecodeLoop, Prefill  # noqa: E402

from engine_throughput import run_engine  # noqa: E402  (this folder: benchmarks/)

BLOCK = 16  # kv.block_size (the default)
HEAD = 128  # linear key/value head dim (published)
FULL_HEAD = 256  # full-attention head dim (published)


# --- the model ------------------------------------------------------------------------------


def build_model(out_dir: Path, hidden: int, layers: int) -> Path:
    """A save_pretrained directory of a random-weight Qwen3.5 text model (written once, reused).

    Qwen3.5's shapes: every fourth layer full attention, linear key and value heads of 128 (16 of
    each in Qwen3.5-0.8B by public descriptions), conv kernel 4, attention heads of 256. Here the
    head counts scale with ``hidden`` (one linear head per 64, one attention head per 128, 2 KV
    heads), the head sizes stay; the other sizes are not claimed to be any checkpoint's.
    """
    if hidden % 128:
        raise SystemExit(f"--hidden must be a multiple of 128, got {hidden}")
    if layers < 2:
        raise SystemExit("--layers must be >= 2 (a linear and a full-attention layer)")
    recipe = {"arch": "qwen3.5-text", "hidden": hidden, "layers": layers, "weights": "random", "version": 1}
    marker = out_dir / "mm_pipeline_bench.json"
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        return out_dir
    from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from pipeline.testing import make_tokenizer
    from pipeline.testing.qwen3_5 import make_text_config

    tok = make_tokenizer("qwen3.5")
    # ids, vocabulary, norms and initializer range (0.15) as the tiny Qwen3.5 family's: wide argmax
    # margins, so that float32 near-ties between the paged forward and generate() stay rare
    text = make_text_config(tok)
    kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    text.update(
        hidden_size=hidden,
        intermediate_size=hidden * 7 // 2,
        num_hidden_layers=layers,
        layer_types=kinds,
        num_attention_heads=hidden // 128,
        num_key_value_heads=min(2, hidden // 128),
        head_dim=FULL_HEAD,
        linear_num_key_heads=hidden // 64,
        linear_num_value_heads=hidden // 64,
        linear_key_head_dim=HEAD,
        linear_value_head_dim=HEAD,
        linear_conv_kernel_dim=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    config = Qwen3_5TextConfig(**text)
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = Qwen3_5ForCausalLM(config).eval()
    finally:
        torch.random.set_rng_state(state)
    with torch.no_grad():  # added tokens (EOS, markers) never win a greedy step (as the tiny models)
        model.get_output_embeddings().weight[sorted(set(tok.get_added_vocab().values()))] = 0.0
    ids = tok.convert_tokens_to_ids
    model.generation_config = GenerationConfig(
        eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")], pad_token_id=ids("<|endoftext|>"), do_sample=False
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    marker.write_text(json.dumps(recipe) + "\n")
    return out_dir


def ordinary_ids(lm: LoadedModel) -> list[int]:
    special = set(lm.tokenizer.all_special_ids) | set(lm.tokenizer.get_added_vocab().values())
    return [i for i in range(len(lm.tokenizer)) if i not in special]


def oracle(lm: LoadedModel, ids: list[int], n: int) -> list[int]:
    """``generate()``'s greedy tokens on ``ids`` (EOS kept, generation goes on: ``ignore_eos``)."""
    x = torch.tensor([ids], device=lm.device)
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=lm.tokenizer.pad_token_id or 0,
        )
    return out[0, len(ids) :].tolist()


class Checker:
    """Every answer against ``generate()`` on the same ids (computed once per distinct ids)."""

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self.want: dict[tuple[tuple[int, ...], int], list[int]] = {}
        self.checked = 0
        self.failed: list[str] = []

    def expected(self, ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in self.want:
            self.want[key] = oracle(self.lm, ids, n)
        return self.want[key]

    def __call__(self, what: str, ids: list[int], got: list[int]) -> None:
        want = self.expected(ids, len(got))
        self.checked += 1
        if got != want:
            self.failed.append(f"{what}: {got[:8]} vs generate {want[:8]}")


def run(pipe: Pipeline, ids: list[int], n: int, cache: KVCache | None = None) -> tuple[list[int], dict]:
    """One request from raw ids, greedy, EOS ignored. Without ``cache`` the request's own cache is
    released at once (its full blocks and registered states stay in the pool's prefix cache): a
    finished request's cache would otherwise wait for the garbage collector (a reference cycle)."""
    ctx = pipe.run_ids(ids, Request(max_new_tokens=n, ignore_eos=True), cache)
    if cache is None:
        ctx.cache.clear()
    return list(ctx.generated), ctx.metrics.to_dict()


def label(every: int, off: int) -> str:
    return "off" if every == off else str(every)


# --- 1. rollback into a long context --------------------------------------------------------


def bench_rollback(
    pipes: dict[int, Pipeline], args: argparse.Namespace, vocab: list[int], check: Checker, off: int
) -> list[dict]:
    rng = random.Random(args.seed)
    context = [rng.choice(vocab) for _ in range(args.context)]
    points = [
        (rng.randrange(args.block, args.context), [rng.choice(vocab) for _ in range(args.suffix)])
        for _ in range(args.rollbacks)
    ]
    everies = list(pipes)
    stats = {e: {"context_ttft": [], "recomputed": [], "ttft": [], "left": []} for e in everies}
    held: dict[int, dict] = {}
    for rep in range(args.reps):
        order = everies[rep % len(everies) :] + everies[: rep % len(everies)]
        bases: dict[int, KVCache] = {}
        for e in order:  # the context, once per E, in rotating order
            pipes[e].pool.clear_prefix_cache()
            bases[e] = pipes[e].new_cache()
            out, m = run(pipes[e], context, 1, bases[e])
            check(f"context E={label(e, off)}", context, out)
            stats[e]["context_ttft"].append(m["ttft_s"])
            if rep == 0:
                cache = bases[e]
                slots = {*cache.checkpoints.values(), cache.slot} - {0}
                held[e] = {
                    "checkpoints": len(cache.checkpoints),
                    "state_slots": len(slots),
                    "kv_bytes": len(cache.blocks) * cache.pool.block_bytes,
                    "state_bytes": len(slots) * cache.pool.states.slot_bytes,
                    "nbytes": cache.nbytes,
                }
        for i, (pos, suffix) in enumerate(points):
            ids = context[:pos] + suffix
            for e in order[i % len(order) :] + order[: i % len(order)]:
                # Only the cache's own checkpoints: earlier follow-ups registered states of their own
                # prompts with the prefix cache, which part 2 measures (the fork holds its blocks).
                pipes[e].pool.clear_prefix_cache()
                branch = bases[e].fork()
                reached = branch.rollback(pos)
                out, m = run(pipes[e], ids, args.new_tokens, branch)
                check(f"rollback to {pos} E={label(e, off)}", ids, out)
                if m["kv_reused_tokens"] + m["prefill_tokens"] != len(ids):
                    check.failed.append(f"rollback to {pos} E={label(e, off)}: reused + prefilled != prompt")
                stats[e]["recomputed"].append(m["prefill_tokens"] - len(suffix))
                stats[e]["left"].append(pos - reached)  # what rollback() said is left to recompute
                stats[e]["ttft"].append(m["ttft_s"])
                branch.clear()
        for cache in bases.values():
            cache.clear()
    base_ttft = statistics.mean(stats[everies[0]]["ttft"])
    ref = off if off in everies else max(everies)  # the context's TTFT against the fewest checkpoints
    off_ctx = statistics.median(stats[ref]["context_ttft"])
    rows = []
    for e in everies:
        s = stats[e]
        rows.append(
            {
                "every": label(e, off),
                "recomputed_mean": statistics.mean(s["recomputed"]),
                "rollback_left_mean": statistics.mean(s["left"]),
                "recomputed_max": max(s["recomputed"]),
                "ttft_s": statistics.mean(s["ttft"]),
                "ttft_vs_smallest": statistics.mean(s["ttft"]) / base_ttft,
                "context_ttft_s": statistics.median(s["context_ttft"]),
                "context_ttft_vs_fewest": statistics.median(s["context_ttft"]) / off_ctx,
                "context_ref": label(ref, off),
                **held[e],
            }
        )
    return rows


# --- 2. prefix reuse across requests --------------------------------------------------------


def bench_prefix(
    pipes: dict[int, Pipeline], args: argparse.Namespace, vocab: list[int], check: Checker, off: int
) -> list[dict]:
    rng = random.Random(args.seed + 1)
    first = [rng.choice(vocab) for _ in range(args.context)]
    shared = args.shared or (3 * args.context // 4 + args.block // 2 + 1)
    cases = {"branch": (first, first[:shared] + [rng.choice(vocab) for _ in range(args.suffix)])}
    answer = check.expected(first, args.new_tokens)  # the next turn: the prompt, the whole answer, more
    cases["extend"] = (first, first + answer + [rng.choice(vocab) for _ in range(args.suffix)])
    everies = list(pipes)
    stats = {(c, e): {"reused": [], "warm": [], "cold": []} for c in cases for e in everies}
    for rep in range(args.reps):
        for case, (a, b) in cases.items():
            order = everies[rep % len(everies) :] + everies[: rep % len(everies)]
            for e in order:
                pipe = pipes[e]
                for kind in ("cold", "warm") if rep % 2 == 0 else ("warm", "cold"):
                    pipe.pool.clear_prefix_cache()
                    if kind == "warm":
                        out, _ = run(pipe, a, args.new_tokens)  # its cache is released on return
                        check(f"{case} first E={label(e, off)}", a, out)
                    out, m = run(pipe, b, args.new_tokens)
                    check(f"{case} {kind} E={label(e, off)}", b, out)
                    stats[(case, e)][kind].append(m["ttft_s"])
                    if kind == "warm":
                        stats[(case, e)]["reused"].append(m["kv_reused_tokens"])
    rows = []
    for (case, e), s in stats.items():
        a, b = cases[case]
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        rows.append(
            {
                "case": case,
                "every": label(e, off),
                "shared_tokens": common,
                "prompt_tokens": len(b),
                "reused": max(s["reused"]),
                "reused_min": min(s["reused"]),
                "warm_ttft_s": statistics.median(s["warm"]),
                "cold_ttft_s": statistics.median(s["cold"]),
                "ttft_vs_cold": statistics.median(w / c for w, c in zip(s["warm"], s["cold"])),
            }
        )
    return rows


# --- 3. decode ------------------------------------------------------------------------------


def bench_decode(lm: LoadedModel, args: argparse.Namespace, vocab: list[int], check: Checker) -> dict:
    rng = random.Random(args.seed + 2)
    prompt = [rng.choice(vocab) for _ in range(args.decode_prompt)]
    n = args.decode_tokens
    single = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, max_seqs=1)
    x = torch.tensor([prompt], device=lm.device)

    def gen(k: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = lm.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=k,
                eos_token_id=None,
                pad_token_id=lm.tokenizer.pad_token_id or 0,
            )
        return time.perf_counter() - t0, out[0, len(prompt) :].tolist()

    gen(2)
    run(single, prompt, 2)  # untimed: allocator, lazy imports
    rates: dict[str, list[float]] = {"generate": [], "pipeline": []}
    for rep in range(args.reps):
        for name in ("generate", "pipeline") if rep % 2 == 0 else ("pipeline", "generate"):
            if name == "generate":
                t1, _ = gen(1)
                tn, out = gen(n)
                rates[name].append((n - 1) / (tn - t1))
            else:
                single.pool.clear_prefix_cache()
                out, m = run(single, prompt, n)
                rates[name].append((n - 1) / (m["total_s"] - m["ttft_s"]))
            check(f"decode {name}", prompt, out)
    ratios = [p / g for p, g in zip(rates["pipeline"], rates["generate"])]

    # B requests at once through the engine vs one after another (varied prompt lengths).
    prompts = [
        [rng.choice(vocab) for _ in range(rng.randrange(args.decode_prompt // 2, 2 * args.decode_prompt + 1))]
        for _ in range(args.batch)
    ]
    batched = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, max_seqs=args.batch)

    def together() -> tuple[float, list[list[int]]]:
        return run_engine(batched, prompts, n, at_once=True)[:2]

    def alone() -> tuple[float, list[list[int]]]:
        single.pool.clear_prefix_cache()
        t0 = time.perf_counter()
        outs = [run(single, p, n)[0] for p in prompts]
        return time.perf_counter() - t0, outs

    seconds: dict[str, list[float]] = {"together": [], "alone": []}
    for rep in range(args.reps):
        for name in ("together", "alone") if rep % 2 == 0 else ("alone", "together"):
            s, outs = together() if name == "together" else alone()
            seconds[name].append(s)
            for p, out in zip(prompts, outs):
                check(f"batch {name}", p, out)
    tokens = args.batch * n
    return {
        "prompt_tokens": len(prompt),
        "new_tokens": n,
        "generate_tok_s": statistics.median(rates["generate"]),
        "pipeline_tok_s": statistics.median(rates["pipeline"]),
        "pipeline_vs_generate": statistics.median(ratios),
        "batch": args.batch,
        "batch_prompts": [len(p) for p in prompts],
        "together_tok_s": tokens / statistics.median(seconds["together"]),
        "alone_tok_s": tokens / statistics.median(seconds["alone"]),
        "together_vs_alone": statistics.median(a / t for a, t in zip(seconds["alone"], seconds["together"])),
    }


# --- main -----------------------------------------------------------------------------------


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small smoke: tiny model, short context, 1 rep")
    ap.add_argument("--model", help="a save_pretrained Qwen3.5 directory (default: build one, see --hidden/--layers)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size of the built model (multiple of 128)")
    ap.add_argument(
        "--layers", type=int, default=8, help="decoder layers of the built model (every fourth full attention)"
    )
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | auto")
    ap.add_argument("--cache-dir", help="where the built model is written (default: $TMPDIR/mm-pipeline-bench)")
    ap.add_argument(
        "--every",
        default="64,256,1024,off",
        help="kv.state_checkpoint_every values, smallest first (multiples of 16); off: only prompt ends",
    )
    ap.add_argument("--context", type=int, default=2048, help="L: tokens of the long context")
    ap.add_argument("--rollbacks", type=int, default=5, help="R: rollbacks per repetition (seeded positions)")
    ap.add_argument("--suffix", type=int, default=16, help="new tokens after each rollback / shared prefix")
    ap.add_argument("--new-tokens", type=int, default=4, help="tokens generated by each follow-up")
    ap.add_argument("--shared", type=int, default=0, help="L': tokens the branch request shares (default 3L/4 + 9)")
    ap.add_argument("--decode-prompt", type=int, default=64, help="prompt tokens of the decode runs")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens generated in the decode runs")
    ap.add_argument("--batch", type=int, default=8, help="requests submitted together in the batch run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default); 1 by default, see the module docstring",
    )
    ap.add_argument("--parts", default="rollback,prefix,decode", help="which measurements to run")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.quick:  # smaller defaults; options given still win
        ap.set_defaults(
            hidden=128,
            layers=4,
            context=192,
            rollbacks=3,
            reps=1,
            every="16,64,off",
            decode_prompt=32,
            decode_tokens=12,
            batch=4,
        )
        args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.block = BLOCK
    off = BLOCK * (-(-(args.context + args.suffix + max(args.new_tokens, args.decode_tokens) + 1) // BLOCK) + 1)
    everies = []
    for v in args.every.split(","):
        e = off if v.strip() == "off" else int(v)
        if e % BLOCK or e <= 0:
            raise SystemExit(f"--every: {v} is not a positive multiple of {BLOCK}")
        everies.append(e)
    parts = set(args.parts.split(","))
    if not parts or parts - {"rollback", "prefix", "decode"}:
        raise SystemExit(f"--parts: choose among rollback, prefix, decode (got {args.parts})")
    if args.rollbacks < 1 or args.context < 2 * BLOCK or args.new_tokens < 1 or args.decode_tokens < 2:
        raise SystemExit("need --rollbacks >= 1, --context >= 32, --new-tokens >= 1 and --decode-tokens >= 2")

    t0 = time.perf_counter()
    if args.model is None:
        cache = Path(args.cache_dir or Path(tempfile.gettempdir()) / "mm-pipeline-bench")
        args.model = str(build_model(cache / f"qwen3.5-text-h{args.hidden}-l{args.layers}", args.hidden, args.layers))
    build_s = time.perf_counter() - t0
    lm = load_model(args.model, dtype=args.dtype)
    text = lm.config.get_text_config()
    if "linear_attention" not in getattr(text, "layer_types", []):
        raise SystemExit(f"{args.model} has no linear-attention layers")
    vocab = ordinary_ids(lm)
    pipes = {
        e: Pipeline(
            lm,
            {"prefill": Prefill(), "decode": DecodeLoop()},
            kv_block_size=BLOCK,
            kv_state_checkpoint_every=e,
            max_seqs=2,
        )
        for e in everies
    }
    pool = pipes[everies[0]].pool
    params = sum(p.numel() for p in lm.model.parameters())
    kinds = text.layer_types
    print(
        f"model {args.model}: {params / 1e6:.1f} M parameters, hidden {text.hidden_size}, {len(kinds)} layers "
        f"({kinds.count('linear_attention')} linear), dtype {lm.model.dtype}, {torch.get_num_threads()} threads"
        + (f", built in {build_s:.0f} s" if build_s > 1 else ""),
        file=sys.stderr,
    )
    print(
        f"one state {mib(pool.states.slot_bytes)} MiB = {pool.states.slot_bytes / pool.block_bytes * BLOCK:.0f} "
        f"tokens of KV ({pool.block_bytes / BLOCK / 1024:.1f} KiB a token); context {args.context}, "
        f"{args.rollbacks} rollbacks x {args.reps} reps, E = {', '.join(label(e, off) for e in everies)}",
        file=sys.stderr,
    )

    check = Checker(lm)
    rng = random.Random(args.seed + 3)
    warm = [rng.choice(vocab) for _ in range(min(args.context, 6 * BLOCK + 3))]
    for e in everies:  # untimed: first-use allocations, lazy imports, both delta-rule kernels
        run(pipes[e], warm, 3)
        pipes[e].pool.clear_prefix_cache()
    oracle(lm, warm[:BLOCK], 2)
    t0 = time.perf_counter()
    rollback = prefix = decode = None
    if "rollback" in parts:
        rollback = bench_rollback(pipes, args, vocab, check, off)
        print(f"rollbacks done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if "prefix" in parts:
        prefix = bench_prefix(pipes, args, vocab, check, off)
        print(f"prefix reuse done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if "decode" in parts:
        decode = bench_decode(lm, args, vocab, check)
        print(f"decode done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    print(report(args, rollback, prefix, decode, check))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": {k: v for k, v in vars(args).items()},
                    "torch": torch.__version__,
                    "machine": platform.machine(),
                    "threads": torch.get_num_threads(),
                    "slot_bytes": pool.states.slot_bytes,
                    "block_bytes": pool.block_bytes,
                    "rollback": rollback,
                    "prefix": prefix,
                    "decode": decode,
                    "checked": check.checked,
                    "mismatches": check.failed,
                },
                indent=2,
            )
        )
    if check.failed:
        print("tokens differ from generate():\n  " + "\n  ".join(check.failed[:20]), file=sys.stderr)
        return 1
    return 0


def report(
    args: argparse.Namespace,
    rollback: list[dict] | None,
    prefix: list[dict] | None,
    decode: dict | None,
    check: Checker,
) -> str:
    """The markdown tables of the parts that ran."""
    lines: list[str] = []
    if rollback:
        lines += [
            f"1. Rollback into a {args.context}-token context ({args.rollbacks} seeded positions x {args.reps} "
            f"reps, {args.suffix} new tokens after each)",
            "",
            f"| E | recomputed mean | max | follow-up TTFT ms | vs E={rollback[0]['every']} | context TTFT vs "
            f"E={rollback[0]['context_ref']} | checkpoints | KV blocks MiB | states MiB | cache MiB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rollback:
            lines.append(
                f"| {r['every']} | {r['recomputed_mean']:.0f} | {r['recomputed_max']} | {1e3 * r['ttft_s']:.1f} | "
                f"**{r['ttft_vs_smallest']:.2f}** | {r['context_ttft_vs_fewest']:.2f} | {r['checkpoints']} | "
                f"{mib(r['kv_bytes'])} | {mib(r['state_bytes'])} | {mib(r['nbytes'])} |"
            )
        for r in rollback:
            if abs(r["rollback_left_mean"] - r["recomputed_mean"]) > 1e-9:
                lines.append(
                    f"note: E={r['every']}: rollback() left {r['rollback_left_mean']:.1f} tokens to recompute "
                    f"on average, the follow-up recomputed {r['recomputed_mean']:.1f}"
                )
        lines.append("")
    if prefix:
        lines += [
            "2. Prefix reuse across requests (the first request released; TTFT vs the same request cold)",
            "",
            "| case | E | shared | prompt | kv_reused_tokens | TTFT ms | cold ms | vs cold |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in prefix:
            reused = str(r["reused"]) if r["reused"] == r["reused_min"] else f"{r['reused_min']}-{r['reused']}"
            lines.append(
                f"| {r['case']} | {r['every']} | {r['shared_tokens']} | {r['prompt_tokens']} | {reused} | "
                f"{1e3 * r['warm_ttft_s']:.1f} | {1e3 * r['cold_ttft_s']:.1f} | **{r['ttft_vs_cold']:.2f}** |"
            )
        lines.append("")
    if decode:
        d = decode
        lines += [
            f"3. Decode ({d['prompt_tokens']}-token prompt, {d['new_tokens']} new; batch: {d['batch']} prompts of "
            f"{min(d['batch_prompts'])}-{max(d['batch_prompts'])} tokens)",
            "",
            "| path | tok/s | ratio |",
            "|---|---|---|",
            f"| generate() | {d['generate_tok_s']:.1f} | 1.00 |",
            f"| pipeline, one stream | {d['pipeline_tok_s']:.1f} | **{d['pipeline_vs_generate']:.2f}** |",
            f"| {d['batch']} one at a time | {d['alone_tok_s']:.1f} | 1.00 |",
            f"| {d['batch']} together (engine) | {d['together_tok_s']:.1f} | **{d['together_vs_alone']:.2f}** |",
            "",
        ]
    lines.append(f"tokens = generate(): {check.checked - len(check.failed)}/{check.checked} answers")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
