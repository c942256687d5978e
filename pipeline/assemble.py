"""From a Hydra config to the objects: the loaded model, the stage chain, the request."""
from __future__ import annotations

import sys
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from pipeline.context import Request
from pipeline.errors import UserError
from pipeline.loading import LoadedModel, load_model
from pipeline.pipeline import Pipeline


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def model_path(cfg: DictConfig) -> str:
    """model.path, or the embedded default (built on first use) when no model is chosen."""
    if cfg.model.path:
        return str(cfg.model.path)
    if cfg.model.name:
        raise UserError(f"model {cfg.model.name!r} has no model.path: set model.path=DIR_OR_HUB_ID")
    from pipeline.tiny import default_model_dir

    print(
        "mm-pipeline: no model chosen, running the embedded default: a tiny model with RANDOM weights "
        "(its text is meaningless). Pick a real one with +model=NAME or model.path=DIR.",
        file=sys.stderr,
    )
    return str(default_model_dir())


def quantization_from_cfg(cfg: DictConfig) -> tuple[Any, str]:
    """(transformers quantization config or None, scheme name)."""
    name = str(cfg.quant.get("name", "none"))
    if name == "none":
        return None, "none"
    from pipeline.quant import quantization_config

    return quantization_config(cfg.quant), name


def load_from_cfg(cfg: DictConfig) -> LoadedModel:
    quant, quant_name = quantization_from_cfg(cfg)
    m = cfg.model
    return load_model(
        model_path(cfg),
        dtype=m.dtype,
        device_map=_plain(m.device_map),
        max_memory=_plain(m.max_memory),
        offload_folder=m.offload_folder,
        quantization_config=quant,
        quant_name=quant_name,
        trust_remote_code=bool(m.trust_remote_code),
        processor_kwargs=_plain(m.processor) or None,
    )


def stages_from_cfg(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate cfg.stages in order; a stage set to null is left out."""
    return {name: instantiate(spec) for name, spec in cfg.stages.items() if spec is not None}


def pipeline_from_cfg(cfg: DictConfig, lm: LoadedModel) -> Pipeline:
    return Pipeline(lm, stages_from_cfg(cfg))


def input_paths(cfg: DictConfig) -> list[str]:
    value = _plain(cfg.get("input"))
    if value is None or value == "":
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


def request_from_cfg(cfg: DictConfig, **overrides: Any) -> Request:
    """The request the CLI settings describe; invalid settings fail here, before any model loads."""
    if int(cfg.max_new_tokens) < 1:
        raise UserError(f"max_new_tokens must be >= 1 (got {cfg.max_new_tokens})")
    images, audios = [], []
    paths = input_paths(cfg)
    if paths:
        from pipeline.media import load_media

        images, audios = load_media(paths)
    prompt = cfg.prompt
    if prompt is not None and not str(prompt).strip():
        raise UserError("the prompt is empty: give prompt=TEXT")
    if prompt is None and not paths and "prompt" not in overrides:
        prompt = "Hello! Who are you?"
    stop = _plain(cfg.get("stop")) or []
    fields = dict(
        prompt=None if prompt is None else str(prompt),
        system_prompt=cfg.system_prompt,
        images=images,
        audios=audios,
        max_new_tokens=int(cfg.max_new_tokens),
        ignore_eos=bool(cfg.ignore_eos),
        stop=[stop] if isinstance(stop, str) else [str(s) for s in stop],
        thinking=cfg.thinking,
    )
    fields.update(overrides)
    return Request(**fields)
