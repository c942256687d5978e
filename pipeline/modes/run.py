"""mode=run: one request, the answer streamed to stdout, result.json in the run folder."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from pipeline.cli.assemble import finish_compile, load_from_cfg, pipeline_from_cfg, request_from_cfg, stages_from_cfg
from pipeline.engine.intake import check_media
from pipeline.model.loading import weights_line
from pipeline.metrics import format_table
from pipeline.cli.outputs import run_dir, write_json


def stdout_writer(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def main(cfg: DictConfig) -> None:
    request = request_from_cfg(cfg)  # validate settings, media and stages before loading anything
    stages = stages_from_cfg(cfg)
    check_media(stages, request)
    lm = load_from_cfg(cfg)
    print(weights_line(lm), file=sys.stderr)
    # decode.compile: the warm-up (one sequence) happens here; auto waits only for a cached compile
    pipe = pipeline_from_cfg(cfg, lm, stages, rows=1, wait="cached", said=False)
    print(pipe.pools.describe(), file=sys.stderr)  # the pool's size, and what kv.memory=auto kept free
    result = pipe.run(request, on_text=stdout_writer if cfg.stream else None)
    if not cfg.stream:
        sys.stdout.write(result.text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    path = write_json(run_dir() / "result.json", result.to_dict())
    if cfg.metrics_table:
        print(f"\n[{lm.path}] finish={result.finish_reason}  result: {path}", file=sys.stderr)
        print(format_table(result.metrics), file=sys.stderr)
    if result.metrics.get("decode_compiled") is False and result.metrics.get("tpot_s"):
        pipe.note_eager_step(result.metrics["tpot_s"], rows=1)  # what a later run's wait is weighed against
    finish_compile(pipe, rows=1)
