"""mode=bench: a llama-bench style grid of prefill (pp) and decode (tg) speeds, optionally vs HF generate.

Every cell of ``bench.prompt_lengths`` x ``bench.gen_lengths`` x ``bench.batch_sizes`` is one
test, ``pp{P}+tg{G}`` (``... B{n}`` for n > 1): n synthetic prompts of P random vocabulary ids
(fixed seeds, one per sequence, no special tokens, no template; nothing left in the prefix
cache from an earlier run) are submitted to the engine at once and G tokens are decoded
greedily for each with EOS ignored (llama-batched-bench's axis). Each run yields four figures,
measured the same way for the pipeline and for the baseline so that their ratio is fair:

- ``ttft_s``      start -> every sequence has its first generated token (prefill + first sample)
- ``pp_tok_s``    n * P / ttft_s (aggregate prompt processing speed)
- ``tg_tok_s``    n * (G - 1) / (end - ttft) (aggregate decode speed; none when G = 1)
- ``pptg_tok_s``  n * (P + G) / (end - start) (the combined pp+tg figure)

With ``bench.baseline=hf`` each repetition also runs transformers' ``model.generate()`` on the
same model and ids (greedy, a batch of n equal-length rows, EOS not a stop: ``eos_token_id=None``
keeps the EOS token and goes on, as ``ignore_eos`` does), alternating with the pipeline so that
drifting clocks or thermals hit both alike; rows then carry pipeline / generate ratios.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from tqdm import tqdm

from pipeline.cli.assemble import load_from_cfg, pipeline_from_cfg, speculative_from_cfg
from pipeline.context import Request
from pipeline.errors import UserError, whole_number
from pipeline.model.loading import LoadedModel
from pipeline.metrics import synchronize
from pipeline.cli.outputs import run_dir, save_figure, write_csv, write_json, write_text
from pipeline.pipeline import Pipeline
from pipeline.spec import METHODS, Speculative
from stages import DecodeLoop, Prefill, Sampler

FIGURES: tuple[str, ...] = ("pp_tok_s", "tg_tok_s", "pptg_tok_s", "ttft_s")
BASELINES: tuple[str, ...] = ("hf",)


@dataclass(frozen=True)
class BenchSettings:
    """The grid and how often each cell runs; checked before any model is loaded."""

    prompt_lengths: tuple[int, ...] = (32, 128)
    gen_lengths: tuple[int, ...] = (16, 64)
    batch_sizes: tuple[int, ...] = (1,)
    repetitions: int = 3
    warmup: int = 1
    seed: int = 0
    baseline: str | None = None
    speculative: tuple[str, ...] = ("none",)  # decode.speculative per row group: none, ngram, draft

    @property
    def cells(self) -> list[tuple[int, int, int]]:
        return [(p, g, b) for p in self.prompt_lengths for g in self.gen_lengths for b in self.batch_sizes]


def _lengths(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if value is None:
        raise UserError(f"{name} is empty: give at least one length, e.g. {name}=[32,128]")
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise UserError(f"{name} is empty: give at least one length, e.g. {name}=[32,128]")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 1:
            raise UserError(f"{name} has {item!r}: every length must be an integer >= 1")
    return tuple(dict.fromkeys(items))  # duplicates would only repeat a row


def settings_from_cfg(cfg: DictConfig) -> BenchSettings:
    """The ``bench`` config section as checked settings; any bad value is a one-line UserError."""
    b = cfg.get("bench")
    if b is None:
        raise UserError("mode=bench needs its bench settings: select it with mode=bench")
    baseline = b.get("baseline")
    baseline = None if baseline in (None, "", "none", False) else str(baseline)
    if baseline is not None and baseline not in BASELINES:
        raise UserError(f"bench.baseline must be null or one of {', '.join(BASELINES)} (got {baseline!r})")
    return BenchSettings(
        prompt_lengths=_lengths("bench.prompt_lengths", b.get("prompt_lengths")),
        gen_lengths=_lengths("bench.gen_lengths", b.get("gen_lengths")),
        batch_sizes=_lengths("bench.batch_sizes", b.get("batch_sizes", [1])),
        repetitions=whole_number("bench.repetitions", b.get("repetitions"), 1),
        warmup=whole_number("bench.warmup", b.get("warmup"), 0),
        seed=whole_number("bench.seed", b.get("seed"), 0),
        baseline=baseline,
        speculative=_methods(b.get("speculative", ["none"]), bool(cfg.decode.get("draft_model"))),
    )


def _methods(value: Any, has_draft: bool) -> tuple[str, ...]:
    """bench.speculative: the decode.speculative values to compare, row by row."""
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise UserError("bench.speculative is empty: give e.g. bench.speculative=[none,ngram]")
    for item in items:
        if item not in METHODS:
            raise UserError(f"bench.speculative has {item!r}: each must be one of {', '.join(METHODS)}")
    if "draft" in items and not has_draft:
        raise UserError("bench.speculative has draft: set decode.draft_model=DIR_OR_HUB_ID")
    return tuple(dict.fromkeys(items))


def check_fits(pipe: Pipeline, settings: BenchSettings) -> None:
    """Refuse cells longer than the model's position range or the KV pool (they would fail mid-grid)."""
    longest = max(settings.prompt_lengths) + max(settings.gen_lengths)
    limit = getattr(pipe.lm.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and longest > limit:
        raise UserError(f"bench: {longest} tokens (prompt + generated) exceed the model's {limit} positions")
    if longest > pipe.pool.capacity_tokens:
        raise UserError(
            f"bench: {longest} tokens (prompt + generated) exceed the KV pool's {pipe.pool.capacity_tokens}: "
            "raise kv.memory"
        )


def bench_pipeline(lm: LoadedModel) -> Pipeline:
    """The default chain for Python use: plain Prefill and a greedy DecodeLoop."""
    return Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(Sampler())})


def synthetic_prompt(lm: LoadedModel, length: int, seed: int) -> list[int]:
    """``length`` ids drawn uniformly from the ordinary vocabulary (special and added tokens excluded)."""
    tok = lm.tokenizer
    rows = lm.model.get_input_embeddings().weight.shape[0]
    vocab = min(len(tok), rows)
    excluded = set(getattr(tok, "all_special_ids", [])) | set(getattr(tok, "added_tokens_decoder", {}))
    allowed = torch.tensor([i for i in range(vocab) if i not in excluded], dtype=torch.long)
    if allowed.numel() == 0:
        raise UserError("bench: the tokenizer has no ordinary tokens to build a prompt from")
    g = torch.Generator().manual_seed(seed * 1_000_003 + length)
    return allowed[torch.randint(len(allowed), (length,), generator=g)].tolist()


def _figures(prompt: int, gen: int, ttft: float, total: float, batch: int = 1) -> dict[str, float | None]:
    decode_s = total - ttft
    return {
        "ttft_s": ttft,
        "pp_tok_s": batch * prompt / ttft if ttft > 0 else None,
        "tg_tok_s": batch * (gen - 1) / decode_s if gen > 1 and decode_s > 0 else None,
        "pptg_tok_s": batch * (prompt + gen) / total if total > 0 else None,
    }


def time_pipeline(pipe: Pipeline, prompts: list[list[int]], gen: int) -> dict:
    """One run: every prompt submitted to the engine at once, on an empty prefix cache; the bench
    figures (aggregate over the batch) plus the pipeline's own metrics (of the first sequence)."""
    pipe.pool.clear_prefix_cache()
    handles = [pipe.submit(Request(max_new_tokens=gen, ignore_eos=True), ids=ids, result=False) for ids in prompts]
    ctxs = [pipe.wait(h) for h in handles]
    for ctx in ctxs:
        if len(ctx.generated) != gen:
            raise RuntimeError(f"the engine produced {len(ctx.generated)} tokens instead of {gen}")
    start = min(c.metrics.t_start for c in ctxs)
    first = max(c.metrics.t_first for c in ctxs)
    end = max(c.metrics.t_end for c in ctxs)
    m = pipe.result(ctxs[0]).metrics
    for ctx in ctxs:
        ctx.cache.clear()
    out = _figures(len(prompts[0]), gen, first - start, end - start, len(prompts))
    for key in (
        "prefill_tok_s",
        "decode_tok_s",
        "sample_s",
        "kv_cache_bytes",
        "peak_memory_bytes",
        "kv_pool_bytes",
        "bandwidth_gb_s",
        "spec_accept_rate",
        "spec_tokens_per_step",
    ):
        out[key] = m.get(key)
    return out


class _FirstTokenClock:
    """A generate() streamer that only notes when the first generated token arrives."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.puts = 0
        self.t_first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt itself
            synchronize(self.device)
            self.t_first = time.perf_counter()

    def end(self) -> None:
        pass


def time_generate(lm: LoadedModel, prompts: list[list[int]], gen: int) -> dict:
    """One ``model.generate()`` run: greedy, EOS not a stop, the same ids as one batch; the same figures."""
    input_ids = torch.tensor(prompts, device=lm.device)
    clock = _FirstTokenClock(lm.device)
    pad = lm.tokenizer.pad_token_id
    pad = pad if pad is not None else min(lm.eos_token_ids, default=0)
    synchronize(lm.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=gen,
            eos_token_id=None,  # as ignore_eos: EOS is an ordinary token, generation goes on
            pad_token_id=pad,
            streamer=clock,
        )
    synchronize(lm.device)
    total = time.perf_counter() - t0
    produced = out.shape[1] - len(prompts[0])
    if produced != gen or clock.t_first is None:
        raise RuntimeError(f"generate() produced {produced} tokens instead of {gen}")
    return _figures(len(prompts[0]), gen, clock.t_first - t0, total, len(prompts))


def _stats(samples: list[dict], key: str) -> dict:
    values = [s[key] for s in samples if s.get(key) is not None]
    if not values:
        return {"mean": None, "std": None}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass
class Row:
    """One grid cell: its samples and their mean / standard deviation per figure."""

    test: str
    prompt_tokens: int
    gen_tokens: int
    batch: int = 1
    speculative: str = "none"
    pipeline: list[dict] = field(default_factory=list)
    baseline: list[dict] = field(default_factory=list)

    def stats(self, which: str = "pipeline") -> dict[str, dict]:
        samples = self.pipeline if which == "pipeline" else self.baseline
        return {key: _stats(samples, key) for key in FIGURES}

    def ratios(self) -> dict[str, float | None]:
        """Pipeline speed / baseline speed per throughput figure (> 1: the pipeline is faster)."""
        if not self.baseline:
            return {}
        mine, theirs = self.stats("pipeline"), self.stats("baseline")
        return {key: _ratio(mine[key]["mean"], theirs[key]["mean"]) for key in ("pp_tok_s", "tg_tok_s", "pptg_tok_s")}

    def to_dict(self) -> dict:
        out = {
            "test": self.test,
            "prompt_tokens": self.prompt_tokens,
            "gen_tokens": self.gen_tokens,
            "batch": self.batch,
            "speculative": self.speculative,
            "pipeline": {"stats": self.stats("pipeline"), "samples": self.pipeline},
        }
        if self.baseline:
            out["hf"] = {"stats": self.stats("baseline"), "samples": self.baseline}
            out["ratio"] = self.ratios()
        return out


def run_grid(
    pipe: Pipeline,
    settings: BenchSettings,
    on_run: Callable[[], None] | None = None,
    speculative: dict[str, Any] | None = None,
) -> list[Row]:
    """Warm up, then time every cell ``repetitions`` times (pipeline and baseline alternating).

    ``pipe`` needs ``prefill`` and ``decode`` stages (other stages are not run); its decode
    sampler should be greedy for the baseline comparison to mean anything. ``speculative``:
    method name -> ``Speculative`` (None for plain decoding); each cell gets a row per method,
    run one after the other on the same prompts (``settings.speculative`` when not given: only
    ``none`` needs no draft model).
    """
    missing = [name for name in ("prefill", "decode") if name not in pipe.stages]
    if missing:
        raise UserError(f"bench: the pipeline has no {' or '.join(missing)} stage")
    check_fits(pipe, settings)
    lm = pipe.lm
    if speculative is None:
        speculative = {m: Speculative(m) if m != "none" else None for m in settings.speculative}
    decode = pipe.stages["decode"]
    configured = decode.speculative
    rows: list[Row] = []
    try:
        for p, g, b in settings.cells:
            # Sequence i of every cell gets the same prompt (seed + i): the B=1 cells match the old grid.
            prompts = [synthetic_prompt(lm, p, settings.seed + i) for i in range(b)]
            for method, spec in speculative.items():
                decode.speculative = spec
                label = (
                    f"pp{p}+tg{g}"
                    + (f" B{b}" if b > 1 else "")
                    + ("" if list(speculative) == ["none"] else f" {method}")
                )
                row = Row(label, p, g, b, speculative=method)
                for rep in range(settings.warmup + settings.repetitions):
                    sample = time_pipeline(pipe, prompts, g)
                    if rep >= settings.warmup:
                        row.pipeline.append(sample)
                    if on_run is not None:
                        on_run()
                    if settings.baseline == "hf":
                        sample = time_generate(lm, prompts, g)
                        if rep >= settings.warmup:
                            row.baseline.append(sample)
                        if on_run is not None:
                            on_run()
                rows.append(row)
    finally:
        decode.speculative = configured
    return rows


# --- reports -------------------------------------------------------------------------------------


def _num(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.4g}"


def _pm(stat: dict) -> str:
    if stat["mean"] is None:
        return "n/a"
    return f"{_num(stat['mean'])} ± {_num(stat['std'])}"


def markdown_table(rows: list[Row]) -> str:
    """The llama-bench style table: mean ± stddev per figure, baseline and ratios when measured."""
    with_hf = any(r.baseline for r in rows)
    head = ["test", "pp t/s", "tg t/s", "pp+tg t/s", "TTFT s"]
    if with_hf:
        head += ["hf pp t/s", "hf tg t/s", "hf pp+tg t/s", "hf TTFT s", "ratio pp", "ratio tg", "ratio pp+tg"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|"]
    for r in rows:
        s = r.stats()
        cells = [r.test] + [_pm(s[k]) for k in ("pp_tok_s", "tg_tok_s", "pptg_tok_s", "ttft_s")]
        if with_hf:
            h, q = r.stats("baseline"), r.ratios()
            cells += [_pm(h[k]) for k in ("pp_tok_s", "tg_tok_s", "pptg_tok_s", "ttft_s")]
            cells += [_num(q.get(k)) for k in ("pp_tok_s", "tg_tok_s", "pptg_tok_s")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def csv_rows(rows: list[Row]) -> list[list[Any]]:
    """One line per cell; every figure as ``<figure>_mean`` / ``<figure>_std`` (hf_ prefixed for the baseline)."""
    with_hf = any(r.baseline for r in rows)
    header: list[str] = ["test", "prompt_tokens", "gen_tokens", "batch", "repetitions"]
    for key in FIGURES:
        header += [f"{key}_mean", f"{key}_std"]
    if with_hf:
        for key in FIGURES:
            header += [f"hf_{key}_mean", f"hf_{key}_std"]
        header += ["ratio_pp", "ratio_tg", "ratio_pptg"]
    out: list[list[Any]] = [header]
    for r in rows:
        line: list[Any] = [r.test, r.prompt_tokens, r.gen_tokens, r.batch, len(r.pipeline)]
        for which in ("pipeline", "baseline") if with_hf else ("pipeline",):
            s = r.stats(which)
            for key in FIGURES:
                line += [
                    "" if s[key]["mean"] is None else s[key]["mean"],
                    "" if s[key]["std"] is None else s[key]["std"],
                ]
        if with_hf:
            q = r.ratios()
            line += ["" if q.get(k) is None else q[k] for k in ("pp_tok_s", "tg_tok_s", "pptg_tok_s")]
        out.append(line)
    return out


def plot(rows: list[Row], path: Path, title: str) -> Path:
    """Bars of pp and tg tokens/s per cell with stddev whiskers; the baseline beside when measured."""
    from matplotlib.figure import (
        Figure,
    )  # slow to import, so only to plot; no pyplot: no global backend or figure state

    with_hf = any(r.baseline for r in rows)
    fig = Figure(figsize=(max(6.0, 1.2 * len(rows) + 3), 4.5), layout="constrained")
    axes = fig.subplots(1, 2)
    x = list(range(len(rows)))
    width = 0.38 if with_hf else 0.6
    for ax, key, label in (
        (axes[0], "pp_tok_s", "prefill (pp) tokens/s"),
        (axes[1], "tg_tok_s", "decode (tg) tokens/s"),
    ):
        series = [("pipeline", "mm-pipeline")] + ([("baseline", "HF generate")] if with_hf else [])
        for i, (which, name) in enumerate(series):
            stats = [r.stats(which)[key] for r in rows]
            offset = (i - (len(series) - 1) / 2) * width
            ax.bar(
                [v + offset for v in x],
                [s["mean"] or 0.0 for s in stats],
                width,
                yerr=[s["std"] or 0.0 for s in stats],
                capsize=3,
                label=name,
            )
        ax.set_xticks(x, [r.test for r in rows], rotation=30, ha="right")
        ax.set_title(label)
        ax.set_ylabel("tokens/s")
        if with_hf:
            ax.legend()
    fig.suptitle(title)
    return save_figure(fig, path, dpi=110)


def main(cfg: DictConfig) -> None:
    settings = settings_from_cfg(cfg)  # bad grid values fail before the model loads
    # The configured stages and engine (prefill.chunk_size, decode.compile, kv.*, engine.* are
    # benchmarked as set), except the sampler: always greedy, like the baseline.
    cfg = OmegaConf.merge(cfg, {"stages": {"decode": {"sampler": {"_target_": "stages.Sampler"}}}})
    lm = load_from_cfg(cfg)
    pipe = pipeline_from_cfg(cfg, lm, wait="always")  # decode.compile=auto: measured compiled, as users run
    configured = getattr(
        pipe.stages.get("decode"), "speculative", None
    )  # decode.speculative's own, its draft model loaded once
    speculative = {
        m: configured if configured is not None and configured.method == m else speculative_from_cfg(cfg, lm, m)
        for m in settings.speculative
    }
    runs = (
        len(settings.cells)
        * len(speculative)
        * (settings.warmup + settings.repetitions)
        * (2 if settings.baseline else 1)
    )
    check_fits(pipe, settings)
    with tqdm(total=runs, desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
        rows = run_grid(pipe, settings, on_run=lambda: bar.update(1), speculative=speculative)

    dtype = str(lm.model.dtype).replace("torch.", "")
    title = f"{lm.path}  ({lm.device}, {dtype}, quant={lm.quant})"
    table = markdown_table(rows)
    print(table)
    sys.stdout.flush()
    out = run_dir()
    note = (
        f"greedy, EOS ignored, synthetic prompts (seed {settings.seed}); "
        f"{settings.repetitions} repetitions after {settings.warmup} warmup; mean ± stddev"
    )
    write_text(out / "bench.md", f"# bench: {title}\n\n{note}\n\n{table}\n")
    write_csv(out / "bench.csv", csv_rows(rows))
    write_json(
        out / "bench.json",
        {
            "model": lm.path,
            "device": str(lm.device),
            "dtype": dtype,
            "quant": lm.quant,
            "weights_bytes": lm.weights_bytes,
            "settings": asdict(settings),
            "rows": [r.to_dict() for r in rows],
        },
    )
    plot(rows, out / "bench.png", title)
    print(f"bench results: {out}", file=sys.stderr)
