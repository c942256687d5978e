"""mode=batch input=FILE: many prompts from one file, resumable, and shardable across processes.

Input (kind decided by the file name):
- ``*.jsonl`` / ``*.ndjson``: one JSON object per line: ``id`` (string or integer; the line
  number when left out), ``prompt``, optional ``images`` / ``audios`` (paths relative to the
  file's folder, or absolute) and per-item settings (``max_new_tokens``, ``system_prompt``,
  ``ignore_eos``, ``stop``, ``thinking``). Blank lines are skipped.
- anything else: one prompt per line; blank lines and lines starting with ``#`` are skipped;
  the id is the line number.

A problem with the file itself (bad JSON, a wrong type, a duplicate id) stops the run before
the model loads, naming the line. A problem with one item at run time (a missing image, an
image for a text-only model) is recorded as ``{"id", "prompt", "error"}`` for that item; the
others still run, and the process exits non-zero at the end with a one-line summary.

Output, in the run folder: ``results.jsonl`` (one line per item, in input order: ``id``,
``prompt``, ``text``, ``token_ids``, ``finish_reason``, ``metrics``) and ``summary.json``.

Resume: each finished item is appended (fsync'd) to ``results.part<rank>.jsonl`` as soon as
it finishes; ``results.jsonl`` is written atomically once all are done and the parts are
removed. Running again with the same folder (``hydra.run.dir=DIR``) skips every id that
already has a result with the same prompt and retries the ones that failed.

Scale-out: under ``accelerate launch`` / ``torchrun`` each process takes the items whose
index i satisfies i % num_processes == rank, loads its own model copy on its own device and
writes its own part; the main process waits for all, then merges. Rank 0's run folder is used
by every rank, so Hydra's per-process ``${now:...}`` default cannot split the output.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.assemble import load_from_cfg, pipeline_from_cfg, request_from_cfg
from pipeline.context import Request, Result
from pipeline.errors import UserError, whole_number
from pipeline.outputs import append_jsonl, run_dir, write_json, write_jsonl

# Test hook: hard-exit (os._exit, no cleanup) after this many items were journaled by this
# process, to prove that an interrupted batch resumes without losing or duplicating a line.
EXIT_AFTER_ENV = "MM_PIPELINE_BATCH_EXIT_AFTER"
RESULTS = "results.jsonl"
SUMMARY = "summary.json"
PART_GLOB = "results.part*.jsonl"
JSONL_SUFFIXES = (".jsonl", ".ndjson")
# Per-item settings a JSONL line may carry (each checked by _setting).
ITEM_SETTINGS = ("max_new_tokens", "system_prompt", "ignore_eos", "stop", "thinking")
ITEM_KEYS = ("id", "prompt", "images", "audios") + ITEM_SETTINGS


@dataclass
class Item:
    """One prompt of the batch, as read from the file (media are paths, loaded when it runs)."""

    id: str | int
    line: int
    prompt: str | None = None
    images: list[str] = field(default_factory=list)
    audios: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Ids are compared as text: 7 and "7" are the same item."""
        return str(self.id)


# --- reading the input ---------------------------------------------------------------------
def read_items(path: str | Path) -> list[Item]:
    """Every item of a prompts file, validated; any problem is a UserError naming the line."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(f"input {str(path)!r} does not exist")
    if not path.is_file():
        raise UserError(f"input {str(path)!r} is not a file: give a prompts .txt or .jsonl file")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror})") from None
    if path.suffix.lower() in JSONL_SUFFIXES:
        items = [_json_item(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    else:
        items = [
            Item(id=n, line=n, prompt=line.strip())
            for n, line in enumerate(lines, 1)
            if line.strip() and not line.lstrip().startswith("#")
        ]
    if not items:
        raise UserError(f"{path}: no prompts in the file")
    seen: dict[str, int] = {}
    for item in items:
        if item.key in seen:
            raise UserError(f"{path} line {item.line}: duplicate id {item.id!r} (first on line {seen[item.key]})")
        seen[item.key] = item.line
    return items


def _json_item(path: Path, n: int, line: str) -> Item:
    where = f"{path} line {n}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object like {{\"id\": 1, \"prompt\": \"...\"}}")
    unknown = sorted(set(obj) - set(ITEM_KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(ITEM_KEYS)})")
    item_id = obj.get("id", n)
    if isinstance(item_id, bool) or not isinstance(item_id, (str, int)) or item_id == "":
        raise UserError(f"{where}: id must be a non-empty string or an integer (got {item_id!r})")
    images = _paths(where, path.parent, obj, "images")
    audios = _paths(where, path.parent, obj, "audios")
    prompt = obj.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise UserError(f"{where}: prompt must be a string (got {type(prompt).__name__})")
    if prompt is not None and not prompt.strip():
        raise UserError(f"{where}: the prompt is empty")
    if prompt is None and not (images or audios):
        raise UserError(f"{where}: no prompt (give \"prompt\", or images/audios to describe)")
    settings = {key: _setting(where, key, obj[key]) for key in ITEM_SETTINGS if key in obj}
    return Item(id=item_id, line=n, prompt=prompt, images=images, audios=audios, settings=settings)


def _paths(where: str, base: Path, obj: dict, key: str) -> list[str]:
    value = obj.get(key)
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise UserError(f"{where}: {key} must be a path or a list of paths")
    return [str(p) if (p := Path(v).expanduser()).is_absolute() else str(base / p) for v in values]


def _setting(where: str, key: str, value: Any) -> Any:
    """A per-item setting checked and normalised to what Request takes."""
    if key == "max_new_tokens":
        try:
            whole_number("max_new_tokens", value)
        except UserError as err:
            raise UserError(f"{where}: {err}") from None
    elif key == "ignore_eos":
        if not isinstance(value, bool):
            raise UserError(f"{where}: ignore_eos must be true or false (got {value!r})")
    elif key == "thinking":
        if value is not None and not isinstance(value, bool):
            raise UserError(f"{where}: thinking must be true, false or null (got {value!r})")
    elif key == "system_prompt":
        if value is not None and not isinstance(value, str):
            raise UserError(f"{where}: system_prompt must be a string (got {type(value).__name__})")
    elif key == "stop":
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise UserError(f"{where}: stop must be a string or a list of strings")
    return value


# --- journal and merge -----------------------------------------------------------------------
def read_records(path: Path) -> tuple[list[dict], int]:
    """The records of a results/journal file and how many lines were unreadable.

    A kill can leave the last line half-written; such a line is skipped, never fatal.
    """
    if not path.is_file():
        return [], 0
    records, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(record, dict) and "id" in record:
                records.append(record)
            else:
                bad += 1
    return records, bad


def repair_journal(path: Path) -> None:
    """Cut a half-written last line, so that the next append starts on a line of its own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)
        f.flush()
        os.fsync(f.fileno())


def collect(out: Path, items: list[Item]) -> tuple[dict[str, dict], int]:
    """Best record per id from results.jsonl and every part: a success beats an error, and a
    later error replaces an earlier one. Records whose prompt no longer matches are dropped.

    Returns (records by id, number of stale or unreadable lines left out).
    """
    prompts = {item.key: item.prompt for item in items}
    best: dict[str, dict] = {}
    dropped = 0
    for path in [out / RESULTS, *sorted(out.glob(PART_GLOB))]:
        records, bad = read_records(path)
        dropped += bad
        for record in records:
            key = str(record["id"])
            if key not in prompts or record.get("prompt") != prompts[key]:
                dropped += 1
                continue
            old = best.get(key)
            if old is None or "error" in old:
                best[key] = record
    return best, dropped


# --- running ---------------------------------------------------------------------------------
def success_record(item: Item, result: Result) -> dict:
    return {
        "id": item.id,
        "prompt": item.prompt,
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "metrics": result.metrics,
    }


def error_record(item: Item, message: str) -> dict:
    return {"id": item.id, "prompt": item.prompt, "error": message}


def item_request(cfg: DictConfig, item: Item) -> Request:
    """The item's Request: the run's settings, then the item's own; its media loaded (and checked)."""
    from pipeline.media import media_kind

    for kind, paths in (("image", item.images), ("audio", item.audios)):
        for p in paths:
            if media_kind(p) != kind:
                raise UserError(f"{p}: listed under {kind}s but it is not an {kind} file")
    with open_dict(cfg):
        cfg.input = item.images + item.audios or None
    return request_from_cfg(cfg, prompt=item.prompt, id=item.key, **item.settings)


def run_items(
    pipe: Any, cfg: DictConfig, items: list[Item], shared_prefix: bool, on_record: Callable[[dict], None]
) -> None:
    """Answer each item and hand its record to ``on_record`` as soon as it is finished."""
    if not shared_prefix:
        for item in items:
            try:
                record = success_record(item, pipe.run(item_request(cfg, item)))
            except UserError as err:
                record = error_record(item, str(err))
            on_record(record)
        return
    from pipeline.prefix import run_shared_prefix

    ready: list[tuple[Item, Request, list]] = []
    for item in items:  # load and tokenize first: a bad item must not break the shared prefix
        try:
            request = item_request(cfg, item)
            ready.append((item, request, pipe.tokenize(request).token_keys))
        except UserError as err:
            on_record(error_record(item, str(err)))
    if ready:
        run_shared_prefix(
            pipe,
            [r for _, r, _ in ready],
            on_result=lambda i, result: on_record(success_record(ready[i][0], result)),
            on_error=lambda i, err: on_record(error_record(ready[i][0], str(err))),
            keys=[k for _, _, k in ready],  # tokenized above: the shared length needs no second pass
        )


# --- summary ---------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float | None]:
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def summarize(records: list[dict], **info: Any) -> dict:
    """Totals and TTFT / TPOT / tokens-per-second distributions over the successful items."""
    ok = [r["metrics"] for r in records if "error" not in r]

    def values(key: str) -> list[float]:
        return [m[key] for m in ok if isinstance(m.get(key), (int, float))]

    tokens_s = [
        m["generated_tokens"] / m["total_s"] for m in ok if m.get("total_s") and m.get("generated_tokens") is not None
    ]
    summary: dict[str, Any] = {
        "items": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "totals": {
            key: sum(values(key))
            for key in ("prompt_tokens", "prefill_tokens", "kv_reused_tokens", "generated_tokens", "total_s")
        },
        "ttft_s": distribution(values("ttft_s")),
        "tpot_s": distribution(values("tpot_s")),
        "tokens_per_s": distribution(tokens_s),
    }
    for key in ("prefill_tok_s", "decode_tok_s"):
        summary[key] = distribution(values(key))["mean"]
    peaks = values("peak_memory_bytes")
    summary["peak_memory_bytes"] = max(peaks) if peaks else None
    summary["weights_bytes"] = next((m["weights_bytes"] for m in ok if "weights_bytes" in m), None)
    summary["quant"] = next((m["quant"] for m in ok if "quant" in m), None)
    summary.update(info)
    return summary


# --- processes -------------------------------------------------------------------------------
def process_state(sync_timeout_s: float = 86400) -> Any:
    """accelerate's view of the launch: one process under plain python, N under accelerate/torchrun.

    On a machine without CUDA, accelerate only joins the ranks (gloo) when told ``cpu=True``.
    Ranks that finish early wait at a barrier for the slowest one: the process group's timeout
    (torch's default is 30 minutes) must outlast the longest shard, hence ``sync_timeout_s``.
    """
    from datetime import timedelta

    import torch
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    cpu = not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU")
    return PartialState(cpu=cpu, timeout=timedelta(seconds=sync_timeout_s))


def shared_run_dir(state: Any) -> Path:
    """Rank 0's run folder, for every rank (each rank's Hydra may have stamped its own time)."""
    mine = run_dir().resolve()
    if state.num_processes == 1:
        return mine
    from accelerate.utils import broadcast_object_list

    box = [str(mine)]
    broadcast_object_list(box, from_process=0)
    chosen = Path(box[0])
    if chosen != mine:
        chosen.mkdir(parents=True, exist_ok=True)
        _remove_if_only_hydra(mine)
    return chosen


def _remove_if_only_hydra(folder: Path) -> None:
    """Drop a folder this rank's Hydra made for nothing (only .hydra/ and its log inside)."""
    try:
        if all(p.name == ".hydra" or p.suffix == ".log" for p in folder.iterdir()):
            shutil.rmtree(folder)
    except OSError:
        pass


def place_on_rank(cfg: DictConfig, state: Any) -> None:
    """With several processes and no explicit placement, each loads its copy on its own device."""
    if state.num_processes > 1 and cfg.model.get("device_map") is None:
        device = state.device
        with open_dict(cfg):
            cfg.model.device_map = {"": "cpu" if device.type == "cpu" else str(device)}


def _exit_after() -> int | None:
    value = os.environ.get(EXIT_AFTER_ENV)
    return int(value) if value else None


def main(cfg: DictConfig) -> None:
    opts = cfg.get("batch") or {}
    if cfg.get("input") in (None, "") or OmegaConf.is_list(cfg.input):
        raise UserError("mode=batch needs input=FILE: a prompts .txt (one per line) or .jsonl file")
    if cfg.get("prompt") is not None:
        raise UserError("mode=batch takes its prompts from input=FILE: leave prompt= out")
    items = read_items(str(cfg.input))
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # our copy: input is set per item
    with open_dict(cfg):
        cfg.input = None
    request_from_cfg(cfg, prompt=None)  # the run's own settings fail before the model loads
    shared_prefix = bool(opts.get("shared_prefix", False))
    value = opts.get("sync_timeout_s", 86400)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UserError(f"batch.sync_timeout_s must be a number of seconds > 0 (got {value!r})")
    sync_timeout_s = float(value)

    state = process_state(sync_timeout_s)
    out = shared_run_dir(state)
    rank, n = state.process_index, state.num_processes
    done, dropped = collect(out, items)
    mine = [item for i, item in enumerate(items) if i % n == rank]
    pending = [item for item in mine if item.key not in done or "error" in done[item.key]]
    journal = out / f"results.part{rank}.jsonl"
    repair_journal(journal)
    if state.is_main_process and len(pending) < len(mine):
        print(f"batch: resuming in {out}: {len(mine) - len(pending)} of {len(mine)} items already done", file=sys.stderr)

    if pending:
        from tqdm import tqdm

        place_on_rank(cfg, state)
        lm = load_from_cfg(cfg)
        pipe = pipeline_from_cfg(cfg, lm)
        exit_after, written = _exit_after(), 0
        desc = "batch" if n == 1 else f"batch (rank 0 of {n})"
        show = bool(opts.get("progress", True)) and state.is_main_process
        with tqdm(
            total=len(mine), initial=len(mine) - len(pending), desc=desc, unit="item",
            file=sys.stderr, disable=not show, dynamic_ncols=True,
        ) as bar:

            def on_record(record: dict) -> None:
                nonlocal written
                append_jsonl(journal, record)
                written += 1
                bar.update(1)
                if exit_after is not None and written >= exit_after:
                    os._exit(3)

            try:
                run_items(pipe, cfg, pending, shared_prefix, on_record)
            except KeyboardInterrupt:
                print(f"\nbatch: interrupted; finished items are kept: resume with hydra.run.dir={out}", file=sys.stderr)
                raise

    state.wait_for_everyone()
    if not state.is_main_process:
        return
    finish(out, items, dropped, num_processes=n, shared_prefix=shared_prefix, model=cfg.model.path)


def finish(out: Path, items: list[Item], dropped: int, **info: Any) -> None:
    """Merge parts into the ordered results.jsonl (atomically), write summary.json, report errors."""
    best, _ = collect(out, items)
    missing = [item.id for item in items if item.key not in best]
    if missing:  # only when a rank died without raising: keep the parts for a resume
        raise UserError(f"batch incomplete: no result for id {missing[0]!r} ({len(missing)} missing); run again to resume")
    records = [best[item.key] for item in items]
    write_jsonl(out / RESULTS, records)
    summary = summarize(records, **info)
    write_json(out / SUMMARY, summary)
    for part in out.glob(PART_GLOB):
        part.unlink()
    if dropped:
        print(f"batch: left out {dropped} stale or unreadable line(s) found in {out}", file=sys.stderr)
    t = summary["ttft_s"]["mean"]
    print(
        f"batch: {summary['ok']} of {summary['items']} items answered"
        + (f", mean ttft {t:.4g} s" if t is not None else "")
        + f"; results: {out / RESULTS}",
        file=sys.stderr,
    )
    if summary["errors"]:
        first = next(r for r in records if "error" in r)
        raise UserError(
            f"{summary['errors']} of {summary['items']} items failed (first: id {first['id']!r}: {first['error']}); "
            f"see {out / RESULTS}"
        )
