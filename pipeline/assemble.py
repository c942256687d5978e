"""From a Hydra config to the objects: the loaded model, the stage chain, the request."""
from __future__ import annotations

import sys
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline.context import Request
from pipeline.errors import UserError, whole_number
from pipeline.loading import LoadedModel, load_model
from pipeline.pipeline import Pipeline


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


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


def quant_from_cfg(cfg: DictConfig) -> dict:
    """The quant group as a plain dict, its scheme checked before anything loads.

    load_model resolves ``auto`` and builds the bitsandbytes config: it needs the model's
    config (tied embeddings, already-quantised checkpoints) to do that right.
    """
    from pipeline.quant import scheme_name

    quant = _plain(cfg.get("quant")) or {"name": "none"}
    scheme_name(quant)
    return quant


def processor_kwargs(cfg: DictConfig) -> dict | None:
    """model.processor without its null entries (null = keep the model's own setting), checked."""
    kwargs = {k: v for k, v in (_plain(cfg.model.get("processor")) or {}).items() if v is not None}
    for key in ("min_pixels", "max_pixels"):
        if key in kwargs:
            whole_number(f"model.processor.{key}", kwargs[key])
    if kwargs.get("min_pixels", 0) > kwargs.get("max_pixels", float("inf")):
        raise UserError(
            f"model.processor.min_pixels ({kwargs['min_pixels']}) is above max_pixels ({kwargs['max_pixels']})"
        )
    return kwargs or None


def max_image_pixels(cfg: DictConfig) -> int:
    """media.max_image_pixels: the decompression-bomb guard applied before any image is decoded."""
    from pipeline.media import DEFAULT_MAX_PIXELS

    value = OmegaConf.select(cfg, "media.max_image_pixels", default=DEFAULT_MAX_PIXELS)
    return whole_number("media.max_image_pixels", value)


def load_from_cfg(cfg: DictConfig) -> LoadedModel:
    engine_settings(cfg)  # bad kv.* / engine.* settings fail before the model loads
    quant = quant_from_cfg(cfg)
    m = cfg.model
    return load_model(
        model_path(cfg),
        dtype=m.dtype,
        device_map=_plain(m.device_map),
        max_memory=_plain(m.max_memory),
        offload_folder=m.offload_folder,
        quant=quant,
        trust_remote_code=bool(m.trust_remote_code),
        processor_kwargs=processor_kwargs(cfg),
    )


def stages_from_cfg(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate cfg.stages in order; a stage set to null is left out. Bad settings -> UserError."""
    stages = {}
    for name, spec in cfg.stages.items():
        if spec is None:
            continue
        try:
            stages[name] = instantiate(spec)
        except InstantiationException as err:
            cause = err.__cause__ or err
            raise UserError(f"stages.{name}: {' '.join(str(cause).split())[:300]}") from None
    return stages


def kv_memory(cfg: DictConfig) -> float | int | str:
    """kv.memory checked before the model loads (``paged.kv_memory_setting``)."""
    from pipeline.paged import kv_memory_setting

    return kv_memory_setting(_plain(OmegaConf.select(cfg, "kv.memory", default="auto")))


def max_seqs(cfg: DictConfig) -> int | None:
    value = OmegaConf.select(cfg, "engine.max_seqs", default=None)
    return None if value is None else whole_number("engine.max_seqs", value)


def engine_settings(cfg: DictConfig) -> dict:
    """The pool and engine settings (kv.*, engine.*) as Pipeline keyword arguments, checked."""
    return dict(
        kv_memory=kv_memory(cfg),
        kv_block_size=whole_number("kv.block_size", OmegaConf.select(cfg, "kv.block_size", default=16)),
        max_seqs=max_seqs(cfg),
        max_batch_tokens=whole_number(
            "engine.max_batch_tokens", OmegaConf.select(cfg, "engine.max_batch_tokens", default=2048)
        ),
        burst=whole_number("engine.burst", OmegaConf.select(cfg, "engine.burst", default=8)),
    )


def pipeline_from_cfg(cfg: DictConfig, lm: LoadedModel, stages: dict[str, Any] | None = None) -> Pipeline:
    """The stage chain (``stages``, or built from cfg.stages) on the configured pool and engine.
    When its decode stage compiles (``decode.compile``, or ``stages.decode.compile`` set
    directly: the stage decides, so the two cannot disagree) it is warmed up here, before the
    first request, so TTFT never includes compiling."""
    pipe = Pipeline(lm, stages if stages is not None else stages_from_cfg(cfg), **engine_settings(cfg))
    if getattr(pipe.stages.get("decode"), "compiled", None) is not None:
        print("mm-pipeline: warming up (compiling the decode step)...", file=sys.stderr)
        seconds = pipe.warmup()
        print(f"mm-pipeline: warm-up took {seconds:.1f} s (metrics warmup_s, not part of ttft_s)", file=sys.stderr)
    return pipe


def input_paths(cfg: DictConfig) -> list[str]:
    value = _plain(cfg.get("input"))
    if value is None or value == "":
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


def _tag_sources(images: list, paths: list[str]) -> None:
    """Remember each image's file (PIL ``info["source"]``) so later errors can name it."""
    from pipeline.media import media_kind

    for image, path in zip(images, [p for p in paths if media_kind(p) == "image"]):
        image.info["source"] = path


def request_from_cfg(cfg: DictConfig, **overrides: Any) -> Request:
    """The request the CLI settings describe; invalid settings fail here, before any model loads."""
    try:
        max_new_tokens = int(cfg.max_new_tokens)
    except (TypeError, ValueError):
        max_new_tokens = 0
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1 (got {cfg.max_new_tokens!r})")
    long_audio = cfg.get("media", {}).get("long_audio", "split")
    if long_audio not in ("split", "error"):
        raise UserError(f"media.long_audio must be split or error (got {long_audio!r})")
    images, audios = [], []
    paths = input_paths(cfg)
    if paths:
        from pipeline.media import load_media

        images, audios = load_media(paths, max_pixels=max_image_pixels(cfg))
        _tag_sources(images, paths)
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
        max_new_tokens=max_new_tokens,
        ignore_eos=bool(cfg.ignore_eos),
        stop=[stop] if isinstance(stop, str) else [str(s) for s in stop],
        thinking=cfg.thinking,
    )
    fields.update(overrides)
    return Request(**fields)
