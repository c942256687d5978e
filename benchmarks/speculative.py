"""Speculative decoding (prompt lookup, a draft model) against plain greedy decoding, in one run.

Why these models: speculation pays only where drafts are right, and random-weight tiny models
never repeat their prompt. ``scripts.train.train_copy`` trains (once, then cached) a pair of
Qwen3 models that copy: a 1024-wide target and a 256-wide draft, same tokenizer.

Workloads (held-out passages of 40-80 tokens the training never saw, rendered by Tokenize):

- ``copy``: "Repeat:" + passage; the answer is the passage (copy-heavy: prompt lookup's case);
- ``no lookup``: "Translate:" + passage; each word replaced by another (a fixed cipher): the
  answer's words are nowhere in the prompt, so lookup drafts only from the answer's own past
  (a two-token word's second half) and is mostly wrong. What speculation costs when it cannot help.

Paths, on the target, each prompt run by every path in an order that rotates per prompt and
repetition (greedy, stopping at ``<|im_end|>``; every path must give plain greedy's tokens, or
the script fails): ``plain`` (no speculation; the engine's greedy decode bursts), ``ngram-K``
(prompt lookup, K drafts per step), ``draft-K`` (the draft model, K drafts), ``draft-K-compiled``
(the draft's steps under torch.compile, ``decode.draft_compile``; the target eager as in
``plain``; compiled during the warm-up run, never timed). For reference,
transformers' own ``generate()`` on the same model and prompt ids: plain, with
``prompt_lookup_num_tokens=4`` and with ``assistant_model=`` the draft (4 tokens, constant).

Figures per workload and path, medians over repetitions of each repetition's totals:
decode tok/s = (generated - 1) / (end - first token), wall time, so drafting, verification and
the engine's bookkeeping all count (``generate``: (N - 1) / (t_N - t_1), t_1 from
``max_new_tokens=1``); ``vs plain`` = that over plain's in the same repetition; the engine's own
``decode_tok_s`` metric (forwards and drafting only); ``spec_accept_rate`` (accepted / drafted)
and ``spec_tokens_per_step`` (tokens per target forward).

    python benchmarks/speculative.py            # trains the pair on first use (minutes)
    python benchmarks/speculative.py --quick    # fewer prompts and repetitions
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipeline import Pipeline, Request, load_model  # noqa: E402
from pipeline.model.loading import LoadedModel  # noqa: E402
from scripts.train.train_copy import Example, Task, copy_models, heldout  # noqa: E402
from stages import DecodeLoop, Prefill, Sampler, Speculative, Tokenize  # noqa: E402

WORKLOADS = {"copy": "repeat", "no lookup": "translate"}
MAX_NEW_TOKENS = 256
# The targets: (workloads, path prefix, least ratio to plain, least accept rate): n-gram
# on copy-heavy prompts; the draft model wherever it agrees with the target on >= 70% of drafts;
# n-gram where nothing can be looked up (costs at most 10%).
TARGETS = [
    (("copy",), "ngram", 1.8, 0.0),
    (("copy", "no lookup"), "draft", 1.5, 0.7),
    (("no lookup",), "ngram", 0.9, 0.0),
]


@dataclass
class Tally:
    """One (workload, path) in one repetition: totals over its prompts."""

    tokens: int = 0
    seconds: float = 0.0
    engine_rates: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    steps_tokens: list[float] = field(default_factory=list)

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def add_pipeline(self, m: dict) -> None:
        """One request's metrics: wall decode time (first token to end) and the speculation counters."""
        n = m["generated_tokens"] - 1
        self.add(n, m["tpot_s"] * n if n else 0.0)
        self.engine_rates.append(m["decode_tok_s"] or 0.0)
        self.drafted += m.get("spec_drafted", 0)
        self.accepted += m.get("spec_accepted", 0)
        if m.get("spec_tokens_per_step"):
            self.steps_tokens.append(m["spec_tokens_per_step"])

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def make_pipes(target: LoadedModel, draft: LoadedModel, paths: list[str]) -> dict[str, Pipeline]:
    """One pipeline per path on the same target (one request at a time, as a chat would)."""
    pipes = {}
    for name in paths:
        method, *rest = name.split("-")
        spec = None
        if method == "ngram":
            spec = Speculative("ngram", num_draft=int(rest[0]))
        elif method == "draft":
            spec = Speculative("draft", num_draft=int(rest[0]), draft=draft, compile=rest[1:] == ["compiled"])
        stages = {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop(Sampler(), speculative=spec)}
        pipes[name] = Pipeline(target, stages, max_seqs=1)
    return pipes


def run_pipe(pipe: Pipeline, example: Example, max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[list[int], dict]:
    result = pipe.run(Request(prompt=example.prompt, max_new_tokens=max_new_tokens))
    return result.token_ids, result.metrics


def run_generate(
    target: LoadedModel, draft: LoadedModel, ids: torch.Tensor, how: str, n: int = MAX_NEW_TOKENS
) -> tuple[list[int], float]:
    """transformers' generate on the same ids (greedy, the generation config's EOS): tokens, seconds."""
    extra: dict = {}
    if how == "lookup":
        extra = {"prompt_lookup_num_tokens": 4}
    elif how == "assistant":
        extra = {"assistant_model": draft.model, "num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant"}
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **extra
        )
    return out[0, ids.shape[1] :].tolist(), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 prompts per workload, 2 repetitions")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per workload")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--paths",
        default="plain,ngram-4,ngram-8,draft-4,draft-4-compiled,draft-5-compiled",
        help="plain first; a -compiled draft runs its steps under torch.compile",
    )
    ap.add_argument("--skip-hf", action="store_true", help="leave transformers' generate out")
    ap.add_argument(
        "--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="cap per answer (the answers end sooner)"
    )
    ap.add_argument("--models", help="directory holding copy-target/ and copy-draft/ (default: the cache)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "mm-pipeline-bench",
        help="where speculative.json and speculative.md are written",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.reps = 3, 2
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    target_dir, draft_dir = copy_models(args.models)
    train_s = time.perf_counter() - t0
    target, draft = load_model(str(target_dir)), load_model(str(draft_dir))
    paths = args.paths.split(",")
    if paths[0] != "plain":
        raise SystemExit("--paths must start with plain: every ratio is against it")
    pipes = make_pipes(target, draft, paths)
    task = Task(target.tokenizer)
    prompts = {w: heldout(target.tokenizer, args.prompts, t) for w, t in WORKLOADS.items()}
    hf_paths = [] if args.skip_hf else ["generate", "generate lookup", "generate assistant"]
    print(
        f"target {target_dir}\ndraft  {draft_dir}\n{args.prompts} prompts per workload, {args.reps} reps, "
        f"torch threads {torch.get_num_threads()}" + (f", trained in {train_s:.0f} s" if train_s > 5 else ""),
        file=sys.stderr,
    )

    for pipe in pipes.values():  # warm-up: first-use allocations (pools, the draft's cache)
        run_pipe(pipe, prompts["copy"][0], args.max_new_tokens)

    tallies: dict[tuple[str, str], list[Tally]] = {(w, n): [] for w in prompts for n in paths + hf_paths}
    hf_same = {key: 0 for key in tallies}
    for rep in range(args.reps):
        for workload, examples in prompts.items():
            for name in paths + hf_paths:
                tallies[(workload, name)].append(Tally())
            for i, example in enumerate(examples):
                shift = (rep + i) % len(paths)
                tokens: dict[str, list[int]] = {}
                for name in paths[shift:] + paths[:shift]:
                    tokens[name], m = run_pipe(pipes[name], example, args.max_new_tokens)
                    tallies[(workload, name)][rep].add_pipeline(m)
                for name in paths[1:]:  # speculation must not change a single token
                    if tokens[name] != tokens["plain"]:
                        raise SystemExit(
                            f"{workload} prompt {i}: {name} differs from plain greedy "
                            f"({tokens[name][:12]}... vs {tokens['plain'][:12]}...)"
                        )
                if hf_paths:
                    ids = torch.tensor([task.prompt_ids(example)])
                    _, first = run_generate(target, draft, ids, "plain", n=1)
                    for name in hf_paths:
                        out, seconds = run_generate(
                            target, draft, ids, name.partition(" ")[2] or "plain", args.max_new_tokens
                        )
                        tallies[(workload, name)][rep].add(len(out) - 1, seconds - first)
                        hf_same[(workload, name)] += out == tokens["plain"]
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    return report(args, paths, hf_paths, prompts, tallies, hf_same, train_s)


def report(
    args: argparse.Namespace,
    paths: list[str],
    hf_paths: list[str],
    prompts: dict[str, list[Example]],
    tallies: dict[tuple[str, str], list[Tally]],
    hf_same: dict[tuple[str, str], int],
    train_s: float,
) -> int:
    """Print the markdown tables and the verdicts on the targets; write them and the figures to --out-dir."""
    rows = []
    for (workload, name), reps in tallies.items():
        base = tallies[(workload, "generate" if name.startswith("generate") else "plain")]
        row = {
            "workload": workload,
            "path": name,
            "tok_s": statistics.median(t.tok_s for t in reps),
            "vs_plain": statistics.median(t.tok_s / b.tok_s for t, b in zip(reps, base)),
            "tokens": sum(t.tokens for t in reps) // len(reps),
        }
        if name.startswith("generate"):
            row["same_as_plain"] = f"{hf_same[(workload, name)]}/{len(prompts[workload]) * len(reps)}"
        else:
            row["engine_tok_s"] = statistics.median(r for t in reps for r in t.engine_rates)
            row["engine_vs_plain"] = statistics.median(
                statistics.median(t.engine_rates) / statistics.median(b.engine_rates) for t, b in zip(reps, base)
            )
            drafted = sum(t.drafted for t in reps)
            row["accept_rate"] = sum(t.accepted for t in reps) / drafted if drafted else None
            per_step = [s for t in reps for s in t.steps_tokens]
            row["tokens_per_step"] = statistics.mean(per_step) if per_step else None
        rows.append(row)

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = [
        "| workload | path | decode tok/s | vs plain | engine decode_tok_s | vs plain | accept rate | tokens/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["path"].startswith("generate"):
            lines.append(
                f"| {r['workload']} | {r['path']} | {r['tok_s']:.1f} | **{r['vs_plain']:.2f}** | "
                f"{r['engine_tok_s']:.1f} | {r['engine_vs_plain']:.2f} | {fmt(r['accept_rate'])} | "
                f"{fmt(r['tokens_per_step'])} |"
            )
    if hf_paths:
        lines += [
            "",
            "| workload | transformers | decode tok/s | vs generate | tokens = plain pipeline |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            if r["path"].startswith("generate"):
                lines.append(
                    f"| {r['workload']} | {r['path']} | {r['tok_s']:.1f} | **{r['vs_plain']:.2f}** | "
                    f"{r['same_as_plain']} |"
                )
    lines += ["", "Targets:"]
    for workloads, prefix, least, agreeing in TARGETS:
        best = max(
            (
                r
                for r in rows
                if r["workload"] in workloads
                and r["path"].startswith(prefix + "-")
                and (r["accept_rate"] or 0.0) >= agreeing
            ),
            key=lambda r: r["vs_plain"],
            default=None,
        )
        where = " or ".join(workloads) + (f" (accept rate >= {agreeing})" if agreeing else "")
        if best is None:
            lines.append(f"- {prefix} on {where}: no such row")
            continue
        agree = f", accept rate {best['accept_rate']:.2f}" if best["accept_rate"] is not None else ""
        lines.append(
            f"- {prefix} on {where}: best {best['path']} on {best['workload']}, {best['vs_plain']:.2f}x "
            f"plain{agree} (target >= {least}x): {'met' if best['vs_plain'] >= least else 'NOT met'}"
        )
    text = "\n".join(lines)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    header = (
        f"`python benchmarks/speculative.py{' --quick' if args.quick else ''}`: {args.prompts} prompts per "
        f"workload, {args.reps} reps, torch {torch.__version__}, {platform.machine()}, "
        f"{torch.get_num_threads()} threads\n\n"
    )
    (args.out_dir / "speculative.md").write_text(header + text + "\n")
    (args.out_dir / "speculative.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "train_s": train_s,
                "torch": torch.__version__,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"written: {args.out_dir / 'speculative.md'}, {args.out_dir / 'speculative.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
