"""mode=report dir=SWEEP_DIR: one table of a Hydra multirun (or any folder of runs); loads no model.

Every job folder under ``dir`` (a folder holding ``.hydra/overrides.yaml``) becomes one row:
its overrides as columns (``max_new_tokens``, ``quant`` ...) and its key metrics, read from
whichever result the job's mode wrote: ``result.json`` (run), ``summary.json`` (batch: means)
or ``bench.json`` (bench: one row per grid cell, the pipeline's means). A job that wrote none
of them (it failed) still gets a row, with its status. Each quantity is one column: where a
result also names a swept setting (``quant``), that column holds what the job ran with (``auto``
resolved), or the override itself when the result does not say. Writes ``report.md``, ``report.csv`` and
``report.png`` into ``dir`` and prints the markdown table on stdout.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig

from pipeline.errors import UserError
from pipeline.cli.outputs import save_figure, write_csv, write_text

MEASURED: tuple[str, ...] = ("ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s", "peak_memory_bytes", "weights_bytes")
INFO: tuple[str, ...] = ("quant",)  # what the job ran with, as its result reports it (a setting, not a measure)
METRICS: tuple[str, ...] = MEASURED + INFO  # read from every result
PLOTTED: tuple[str, ...] = ("ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s")
RESULT_FILES: tuple[str, ...] = ("result.json", "summary.json", "bench.json")


def find_jobs(root: Path) -> list[Path]:
    """Job folders (those with .hydra/overrides.yaml) under root, root included, in natural order."""
    jobs = {p.parent.parent for p in root.rglob("overrides.yaml") if p.parent.name == ".hydra"}
    return sorted(jobs, key=lambda p: _natural(p.relative_to(root).as_posix()))


def _natural(text: str) -> list:
    """Sort key that puts job 2 before job 10."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text)]


def read_overrides(job: Path) -> dict[str, str]:
    """key -> value of the job's command-line overrides (``+``/``++``/``~`` prefixes dropped)."""
    try:
        entries = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text(encoding="utf-8")) or []
    except (OSError, yaml.YAMLError):
        return {}
    out: dict[str, str] = {}
    for entry in entries if isinstance(entries, list) else []:
        key, sep, value = str(entry).partition("=")
        if sep:
            out[key.lstrip("+~")] = value
    return out


def _load(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _mean(values: list[Any]) -> float | None:
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(nums) / len(nums) if nums else None


def _value(doc: dict, key: str) -> Any:
    """A metric from a result/summary: a plain number, or the mean of a distribution."""
    value = doc.get(key)
    return value.get("mean") if isinstance(value, dict) else value


def metric_rows(job: Path) -> list[dict[str, Any]]:
    """The job's metric rows: one for run / batch, one per grid cell for bench."""
    for name in RESULT_FILES:
        path = job / name
        if not path.is_file():
            continue
        try:
            doc = _load(path)
        except (OSError, ValueError):
            return [{"status": f"unreadable {name}"}]
        if not isinstance(doc, dict):
            return [{"status": f"unreadable {name}"}]
        if name == "result.json":
            metrics = doc.get("metrics") or {}
            return [{"status": "ok", "source": name, **{k: _value(metrics, k) for k in METRICS}}]
        if name == "summary.json":
            errors = doc.get("errors") or 0
            status = "ok" if not errors else f"{errors} of {doc.get('items')} items failed"
            return [{"status": status, "source": name, **{k: _value(doc, k) for k in METRICS}}]
        return _bench_rows(doc) or [{"status": "no rows in bench.json", "source": name}]
    return [{"status": "no result (job failed?)"}]


def _bench_rows(doc: dict) -> list[dict[str, Any]]:
    rows = []
    for cell in doc.get("rows") or []:
        samples = ((cell or {}).get("pipeline") or {}).get("samples") or []
        tg = [s.get("tg_tok_s") for s in samples]
        peaks = [s.get("peak_memory_bytes") for s in samples if isinstance(s.get("peak_memory_bytes"), (int, float))]
        rows.append(
            {
                "status": "ok",
                "source": "bench.json",
                "test": cell.get("test"),
                "ttft_s": _mean([s.get("ttft_s") for s in samples]),
                "tpot_s": _mean([1 / v for v in tg if isinstance(v, (int, float)) and v > 0]),
                "prefill_tok_s": _mean([s.get("prefill_tok_s", s.get("pp_tok_s")) for s in samples]),
                "decode_tok_s": _mean([s.get("decode_tok_s", s.get("tg_tok_s")) for s in samples]),
                "peak_memory_bytes": max(peaks) if peaks else None,
                "weights_bytes": doc.get("weights_bytes"),
                "quant": doc.get("quant"),
            }
        )
    return rows


def gather(root: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, rows) of the whole sweep."""
    rows: list[dict[str, Any]] = []
    override_keys: list[str] = []
    for job in find_jobs(root):
        overrides = read_overrides(job)
        override_keys += [k for k in overrides if k not in override_keys]
        name = job.relative_to(root).as_posix() if job != root else "."
        for metrics in metric_rows(job):
            known = {k: v for k, v in metrics.items() if v is not None or k not in overrides}
            rows.append({"job": name, **overrides, **known})
    extra = ["test"] if any("test" in r for r in rows) else []
    # A key both swept and reported (quant) is one column, where the overrides put it.
    columns = list(dict.fromkeys(["job", *override_keys, *extra, *METRICS, "status"]))
    return columns, rows


def _cell(key: str, value: Any) -> str:
    """Human-readable cell for the markdown table (the CSV keeps raw values)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{int(value):,}" if key.endswith("_bytes") else f"{value:.4g}"
    if isinstance(value, int) and key.endswith("_bytes"):
        return f"{value:,}"
    return str(value).replace("|", "\\|")


def markdown(columns: list[str], rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(c, r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def labels(columns: list[str], rows: list[dict[str, Any]]) -> list[str]:
    """Bar labels: only the overrides that differ between rows (else the job folder)."""
    varying = [
        c
        for c in columns
        if c not in MEASURED and c not in ("job", "status") and len({str(r.get(c)) for r in rows}) > 1
    ]
    out = []
    for r in rows:
        parts = [f"{c}={r[c]}" if c != "test" else str(r[c]) for c in varying if r.get(c) is not None]
        out.append("\n".join(parts) if parts else str(r["job"]))
    return out


def plot(columns: list[str], rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Four bar charts (TTFT, TPOT, prefill and decode tokens/s), one bar per row."""
    import matplotlib  # slow to import: only a report that plots loads it

    matplotlib.use("Agg")  # before pyplot: no display needed
    import matplotlib.pyplot as plt

    names = labels(columns, rows)
    width = max(8.0, 0.6 * len(rows) + 4)
    fig, axes = plt.subplots(2, 2, figsize=(width, 7), squeeze=False)
    for ax, key in zip(axes.flat, PLOTTED):
        values = [r.get(key) if isinstance(r.get(key), (int, float)) else float("nan") for r in rows]
        ax.bar(range(len(rows)), values, color="tab:blue")
        ax.set_title(key)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(
            names, fontsize=7, rotation=30 if len(rows) > 4 else 0, ha="right" if len(rows) > 4 else "center"
        )
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(cfg: DictConfig) -> None:
    value = cfg.get("dir")
    if value in (None, ""):
        raise UserError("mode=report needs dir=SWEEP_DIR (a Hydra multirun folder)")
    root = Path(str(value)).expanduser()
    if not root.exists():
        raise UserError(f"report: dir {str(root)!r} does not exist")
    if not root.is_dir():
        raise UserError(f"report: dir {str(root)!r} is not a folder")
    columns, rows = gather(root)
    if not rows:
        raise UserError(f"report: no Hydra job folders (with .hydra/overrides.yaml) under {str(root)!r}")
    table = markdown(columns, rows)
    jobs = len({r["job"] for r in rows})
    write_text(root / "report.md", f"# report: {root}\n\n{jobs} job(s)\n\n{table}\n")
    write_csv(root / "report.csv", [columns] + [["" if r.get(c) is None else r.get(c) for c in columns] for r in rows])
    plot(columns, rows, root / "report.png", f"{root}  ({jobs} jobs)")
    print(table)
    sys.stdout.flush()
    print(f"report: {root / 'report.md'}, report.csv, report.png", file=sys.stderr)
