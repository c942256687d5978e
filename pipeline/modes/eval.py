"""mode=eval: lm-evaluation-harness tasks in-process on the engine; results.json + results.md.

A thin recipe over ``pipeline.frontends.evaluation``: the settings and task names are checked before the
model loads, lm-eval runs its tasks on an ``EngineLM``, and its results land in the run folder.
Under ``accelerate launch`` each process loads its own copy and lm-eval splits the documents.
"""

from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.cli.assemble import load_from_cfg, pipeline_from_cfg, stages_from_cfg
from pipeline.errors import UserError, whole_number
from pipeline.model.loading import weights_line
from pipeline.modes.processes import place_on_rank, process_state, shared_run_dir
from pipeline.cli.outputs import write_jsonl, write_text
from pipeline.cli.settings import plain

INSTALL = "mode=eval needs lm-eval: pip install 'mm-pipeline[eval]' (or pip install 'lm_eval[api]>=0.4.13')"


def task_names(value: Any) -> list[str]:
    """eval.tasks as a list: [a, b] or "a,b"."""
    value = plain(value)
    names = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else None
    names = [str(n).strip() for n in names or [] if str(n).strip()]
    if not names:
        raise UserError("mode=eval needs eval.tasks=[TASK,...] (lm-eval task or group names, e.g. [arc_easy])")
    return names


def limit_of(value: Any) -> int | float | None:
    """eval.limit: documents per task (whole number) or a fraction of each task in (0, 1)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and 0 < value < 1:
        return float(value)
    return whole_number("eval.limit", int(value) if isinstance(value, float) and value.is_integer() else value, 1)


def task_manager(include_path: str | None) -> Any:
    """lm-eval's TaskManager: its own tasks and the user's folder."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).expanduser().is_dir():
        raise UserError(f"eval.include_path {include_path!r} is not a folder")
    return TaskManager(include_path=str(Path(include_path).expanduser()) if include_path else None)


def check_tasks(manager: Any, names: list[str]) -> None:
    """Every name a task, group or tag lm-eval knows (or a task YAML file): a typo stops the run
    before the model loads, with the closest names."""
    known = set(manager.all_tasks)
    for name in names:
        if name not in known and not manager.match_tasks([name]) and not Path(name).is_file():
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UserError(f"unknown lm-eval task {name!r}{hint}: eval.include_path adds your own task YAMLs")


def eval_adapter(cfg: DictConfig) -> str | None:
    """``eval.adapter`` (or ``adapter=``): a ``model.lora`` name, checked before the model loads."""
    name = cfg.eval.get("adapter") or cfg.get("adapter")
    if cfg.eval.get("adapter") and cfg.get("adapter") and cfg.eval.adapter != cfg.adapter:
        raise UserError(f"eval.adapter={cfg.eval.adapter} and adapter={cfg.adapter} disagree: give one")
    if name is not None and name not in (plain(cfg.model.lora) or {}):
        raise UserError(f"eval.adapter={name}: not in model.lora (load it with model.lora={{{name}: DIR}})")
    return name


def main(cfg: DictConfig) -> None:
    try:
        from lm_eval import simple_evaluate
        from lm_eval.utils import handle_non_serializable, make_table
    except ModuleNotFoundError:
        raise UserError(INSTALL) from None
    from pipeline.frontends.evaluation import EngineLM

    settings = cfg.eval
    names, limit = task_names(settings.tasks), limit_of(settings.limit)
    fewshot = None if settings.num_fewshot is None else whole_number("eval.num_fewshot", settings.num_fewshot, 0)
    max_length = None if settings.max_length is None else whole_number("eval.max_length", settings.max_length, 2)
    adapter = eval_adapter(cfg)
    manager = task_manager(settings.include_path)
    check_tasks(manager, names)
    stages = stages_from_cfg(cfg)  # bad stage settings fail before the model loads too
    process = process_state()  # accelerate launch: lm-eval splits the documents over the processes
    out = shared_run_dir(process)
    place_on_rank(cfg, process)
    lm = load_from_cfg(cfg)  # quant=auto keeps the checkpoint's weights here (assemble.MEASURING_MODES)
    if process.is_main_process:
        print(weights_line(lm), file=sys.stderr)
    pipe = pipeline_from_cfg(cfg, lm, stages, wait="cached")  # decode.compile=auto: compiled only if cached
    model = EngineLM(
        pipe,
        max_length=max_length,
        thinking=cfg.thinking,
        progress=process.is_main_process,
        process=process,
        adapter=adapter,
    )
    results = simple_evaluate(
        model=model,
        tasks=names,
        limit=limit,
        num_fewshot=fewshot,
        task_manager=manager,
        apply_chat_template=bool(settings.apply_chat_template),
        fewshot_as_multiturn=bool(settings.fewshot_as_multiturn),
        log_samples=bool(settings.log_samples),
        random_seed=settings.seed,
        numpy_random_seed=settings.seed,
        torch_random_seed=settings.seed,
        fewshot_random_seed=settings.seed,
    )
    if results is None:  # lm-eval returns None on processes other than the first
        return
    for task, samples in (results.pop("samples", None) or {}).items():
        write_jsonl(out / f"samples_{task}.jsonl", json.loads(json.dumps(samples, default=handle_non_serializable)))
    results["config"] = {**results.get("config", {}), "model": lm.path, "quant": lm.quant, "adapter": adapter}
    (out / "results.json").write_text(
        json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    table = make_table(results) + ("\n" + make_table(results, "groups") if results.get("groups") else "")
    write_text(out / "results.md", table)
    print(table)
    print(f"[{lm.path}] results: {out / 'results.json'}  table: {out / 'results.md'}", file=sys.stderr)
