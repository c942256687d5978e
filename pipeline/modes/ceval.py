"""mode=ceval: answer a C-Eval CSV (or a folder of subject CSVs); answers.csv + ceval.json.

A thin recipe over ``pipeline.frontends.ceval_scoring``: validate the files before loading the model, answer
every question on one KV cache (the instruction and few-shot prefix are computed once per
subject), then write the files and print the accuracy.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from pipeline.frontends import ceval_scoring as ceval
from pipeline.cli.assemble import engine_settings, load_from_cfg, stages_from_cfg
from pipeline.errors import UserError, whole_number
from pipeline.model.loading import weights_line
from pipeline.cli.outputs import run_dir, write_csv, write_json
from pipeline.pipeline import Pipeline


def _shots(cfg: DictConfig) -> int:
    return whole_number("ceval.shots", cfg.ceval.get("shots", 5), 0)


def main(cfg: DictConfig) -> None:
    data = cfg.get("data")
    if data is None or not str(data).strip():
        raise UserError("mode=ceval needs data=FILE_OR_DIR (a C-Eval CSV or a folder of subject CSVs)")
    shots = _shots(cfg)
    instruction = str(cfg.ceval.get("instruction") or ceval.DEFAULT_INSTRUCTION)
    questions = ceval.load_questions(str(data))
    dev = ceval.load_dev(str(cfg.ceval.dev)) if cfg.ceval.get("dev") else None
    subjects = list(dict.fromkeys(q.subject for q in questions))
    for subject in subjects:  # a missing dev subject fails now, not after an hour of answering
        ceval.shots_for(dev, subject, shots)
    thinking = False if cfg.thinking is None else bool(cfg.thinking)
    stages = stages_from_cfg(cfg)  # bad stage settings fail before the model loads too

    lm = load_from_cfg(cfg)  # quant=auto keeps the checkpoint's weights here (assemble.MEASURING_MODES)
    print(weights_line(lm), file=sys.stderr)
    # No decode warm-up or static cache: C-Eval never decodes, and a dynamic cache crops cheaply.
    pipe = Pipeline(lm, stages, **engine_settings(cfg))  # kv.* and engine.* as every mode
    graded = {"n": 0, "correct": 0}
    bar = tqdm(total=len(questions), desc="ceval", unit="q", file=sys.stderr, dynamic_ncols=True)

    def progress(pred: ceval.Prediction) -> None:
        if pred.correct is not None:
            graded["n"] += 1
            graded["correct"] += int(pred.correct)
            bar.set_postfix(acc=f"{graded['correct'] / graded['n']:.3f}", refresh=False)
        bar.update(1)

    try:
        preds = ceval.evaluate(
            pipe, questions, dev=dev, shots=shots, instruction=instruction, thinking=thinking, on_prediction=progress
        )
    finally:
        bar.close()

    out = run_dir()
    is_folder = Path(str(data)).expanduser().is_dir()
    answers = write_csv(out / "answers.csv", ceval.answers_rows(preds, with_subject=is_folder))
    summary = ceval.summarize(preds)
    if summary is None:
        print(f"answered {len(preds)} questions (no answers given, no accuracy): {answers}", file=sys.stderr)
        return
    summary.update(
        model=lm.path,
        data=str(data),
        shots=shots if dev is not None else 0,
        questions=len(preds),
        prompt_tokens=sum(p.prompt_tokens for p in preds),
        prefill_tokens=sum(p.prefill_tokens for p in preds),
        kv_reused_tokens=sum(p.kv_reused_tokens for p in preds),
        seconds=sum(p.seconds for p in preds),
    )
    path = write_json(out / "ceval.json", summary)
    width = max(len(s) for s in summary["subjects"])
    for subject, rec in summary["subjects"].items():
        print(f"{subject:<{width}}  {rec['accuracy']:.4f}  ({rec['correct']}/{rec['total']})")
    print(f"{'overall':<{width}}  {summary['accuracy']:.4f}  ({summary['correct']}/{summary['total']})")
    print(
        f"[{lm.path}] reused {summary['kv_reused_tokens']} of {summary['prompt_tokens']} prompt tokens; "
        f"answers: {answers}  accuracy: {path}",
        file=sys.stderr,
    )
