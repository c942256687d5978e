"""From a Hydra config to the objects: the loaded model, the stage chain, the request.

The settings were checked once where the config entered (``pipeline.cli.settings``: types while
Hydra composed, rules in ``check`` before the mode started), so this module only reads them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig
from transformers import AutoTokenizer

from pipeline.context import Request
from pipeline.errors import UserError
from pipeline.families import family_for_config
from pipeline.model.loading import (
    LoadedModel,
    _check_path,
    _load_error,
    load_model,
    local_files_only,
    parse_max_memory,
    read_config,
    resolve_dtype,
)
from pipeline.kv import kv_memory_setting, state_budget, state_shape
from pipeline.model.lora import check_adapter
from pipeline.kv.offload import check_offload
from pipeline.memory import fmt_bytes, kv_bytes
from pipeline.media import Inputs, load_inputs
from pipeline.pipeline import Pipeline, check_stages, follow
from pipeline.structured.response_format import cli_constraint
from pipeline.runner.compiled import compile_choice
from pipeline.runner.grammar import constraint_of
from pipeline.runner.inductor_cache import failed_before
from pipeline.spec import Speculative, check_same_tokenizer
from pipeline.cli.settings import KVSettings, plain as _plain
from pipeline.tiny import default_model_dir, model_card
from pipeline.tiny.shapes import COUNT_QUESTION, SHAPES_QUESTION


def model_path(cfg: DictConfig) -> str:
    """model.path, or the embedded default (shipped in the package) when no model is chosen."""
    if cfg.model.path:
        return str(cfg.model.path)
    print(
        "mm-pipeline: no model chosen, running the embedded default: a toy Qwen2-VL model trained by this "
        f'project to name the shapes in images (ask "{SHAPES_QUESTION}" or "{COUNT_QUESTION}"; '
        "other prompts get meaningless text). Pick a real one with +model=NAME or model.path=DIR.",
        file=sys.stderr,
    )
    return str(default_model_dir())


def embedded_example() -> tuple[str, str]:
    """The image and question of a run with no input and no prompt on the embedded default: its
    example image (the same as examples/shapes.png) and the question it was trained on."""
    path = default_model_dir()
    card = model_card(path) or {}
    return str(path / card["example_image"]), card["default_prompts"]["image"]


def quant_from_cfg(cfg: DictConfig) -> dict:
    """The quant group as a plain dict. load_model resolves ``auto`` and builds the bitsandbytes
    config: it needs the model's config (tied embeddings, already-quantised checkpoints)."""
    return _plain(cfg.get("quant")) or {"name": "none"}


def processor_kwargs(cfg: DictConfig) -> dict | None:
    """model.processor without its null entries (null = keep the model's own setting)."""
    return {k: v for k, v in (_plain(cfg.model.get("processor")) or {}).items() if v is not None} or None


def max_image_pixels(cfg: DictConfig) -> int:
    """media.max_image_pixels: the decompression-bomb guard applied before any image is decoded."""
    return int(cfg.media.max_image_pixels)


def video_sampling(cfg: DictConfig) -> tuple[float, int]:
    """media.video_fps and media.video_max_frames: how clips are sampled before the processor."""
    return float(cfg.media.video_fps), int(cfg.media.video_max_frames)


# Modes that measure the model itself: under quant=auto they keep the checkpoint's weights, so their
# scores compare with other harnesses' on the same checkpoint (lm-eval's hf model); quant= is honoured.
MEASURING_MODES = ("eval", "ceval")


def auto_keeps(cfg: DictConfig) -> str:
    """Why quant=auto keeps the checkpoint's weights in this run (``load_model``'s ``auto_keeps``)."""
    mode = str(cfg.mode.name)
    if mode not in MEASURING_MODES:
        return ""
    return f"mode={mode} (evaluation measures the model; give quant=int8wo to evaluate int8 weights)"


def load_from_cfg(cfg: DictConfig) -> LoadedModel:
    quant = quant_from_cfg(cfg)
    m = cfg.model
    path = model_path(cfg)
    if cfg.decode.speculative == "draft":  # a draft that cannot serve is refused before the target loads
        check_draft_tokenizer(path, str(cfg.decode.draft_model), bool(m.trust_remote_code))
    config = read_config(path, bool(m.trust_remote_code))
    check_settings_for_model(cfg, config, path)
    lora = {str(name): str(source) for name, source in (_plain(m.lora) or {}).items()}
    for name, source in lora.items():  # a missing or foreign adapter is refused before the weights load
        check_adapter(name, source)
    lm = load_model(
        path,
        dtype=m.dtype,
        device_map=_plain(m.device_map),
        max_memory=_plain(m.max_memory),
        offload_folder=m.offload_folder,
        quant=quant,
        trust_remote_code=bool(m.trust_remote_code),
        processor_kwargs=processor_kwargs(cfg),
        config=config,
        tp=int(m.tp),
        auto_keeps=auto_keeps(cfg),
    )
    for name, source in lora.items():
        lm.load_adapter(name, source, base=served_base(cfg))
    return lm


def served_base(cfg: DictConfig) -> str | None:
    """The name ``mode=serve`` gives the base model (an adapter may not take it)."""
    serve = cfg.get("serve")
    return None if serve is None else serve.get("model_name")


def follow_from_cfg(cfg: DictConfig) -> None:
    """Ranks 1..N-1 of a tensor-parallel launch: load this rank's shard of the model, then run
    rank 0's steps on it until rank 0 finishes (``pipeline.runner.mirror``)."""
    follow(load_from_cfg(cfg))


def check_settings_for_model(cfg: DictConfig, config: Any, path: str) -> None:
    """The settings that only the model's config.json can judge, judged on it before the weights
    load (minutes for a large model): that a family runs it, ``kv.memory`` in bytes and
    ``kv.state_checkpoint_every``.
    (A fraction of free memory or ``auto`` depends on what is free after loading: ``pool_for``.)"""
    model = model_label(cfg, path)
    family_for_config(config)  # a model no family runs is refused first, in its own words
    check_state_checkpoint_setting(int(cfg.kv.state_checkpoint_every), config, model)
    check_offload_setting(str(cfg.kv.offload), config, int(cfg.model.tp), model)
    memory = kv_memory_setting(_plain(cfg.kv.memory))
    if isinstance(memory, int):
        check_kv_bytes_hold_a_block(
            memory,
            int(cfg.kv.block_size),
            int(cfg.kv.state_checkpoint_every),
            config,
            kv_dtypes(cfg, config),
            model,
            str(cfg.kv.dtype),
        )


def check_offload_setting(offload: str, config: Any, tp: int, model: str) -> None:
    """``kv.offload`` that the pool would refuse (``pipeline.kv.offload``), refused before the
    weights load."""
    check_offload(offload, state_shape(config, torch.float32) is not None, tp, model)


def model_label(cfg: DictConfig, path: str) -> str:
    """How messages name the model: +model=NAME, a hub id, or a local directory's name."""
    if cfg.model.name:
        return str(cfg.model.name)
    if not cfg.model.path:
        return "the embedded default model"
    local = Path(path).expanduser()
    return local.name if local.is_dir() else path


def kv_dtypes(cfg: DictConfig, config: Any = None) -> list[torch.dtype]:
    """The dtypes the KV cache may come out in, known before loading: the model's (``model.dtype``
    as ``load_model`` resolves it) and an explicit ``quant.compute_dtype`` (4-bit weights compute,
    and so cache, in it)."""
    device_map = _plain(cfg.model.device_map)
    if device_map is None and parse_max_memory(_plain(cfg.model.max_memory)):
        device_map = "auto"
    dtypes = [resolve_dtype(cfg.model.dtype, device_map, config)]
    compute = (_plain(cfg.get("quant")) or {}).get("compute_dtype")
    if isinstance(getattr(torch, str(compute), None), torch.dtype) and compute != "auto":
        dtypes.append(getattr(torch, str(compute)))
    return dtypes


def check_kv_bytes_hold_a_block(
    memory: int,
    block_size: int,
    checkpoint_every: int,
    config: Any,
    dtypes: list[torch.dtype],
    model: str,
    kv_dtype: str = "auto",
) -> None:
    """``kv.memory`` as a byte count must hold one KV block (and, for a model with linear-attention
    layers, the recurrent-state slots of one sequence).

    Why here: ``pool_for`` refuses it too, but only after the weights loaded; a byte count is
    known before, and one block's size comes from config.json alone. The smallest dtype the cache
    may use is assumed, so a count that the pool would accept is never refused here.
    """
    dtype = min(dtypes, key=lambda d: torch.empty((), dtype=d).element_size())
    block_bytes = kv_bytes(config, block_size, dtype, kv_dtype=kv_dtype)
    if block_bytes <= 0:
        return
    shape = state_shape(config, dtype)
    if shape is None:
        fits, states = memory >= block_bytes, ""
    else:
        fits = state_budget(memory, block_bytes, block_size, shape.slot_bytes, checkpoint_every, 1)[0] >= 1
        states = f" plus the recurrent-state slots of one sequence ({fmt_bytes(shape.slot_bytes)} each)"
    if not fits:
        raise UserError(
            f"kv.memory={memory:,} bytes cannot hold one KV block of {block_size} tokens ({block_bytes:,} bytes "
            f"for {model} in {str(dtype).removeprefix('torch.') if kv_dtype == 'auto' else f'kv.dtype={kv_dtype}'})"
            f"{states}: raise kv.memory or use kv.memory=auto"
        )


def check_state_checkpoint_setting(every: int, config: Any, model: str) -> None:
    """``kv.state_checkpoint_every`` set away from its default on a model without linear-attention
    layers is refused: only recurrent states are checkpointed, so the setting would do nothing,
    silently. Set to the default (1024), it passes whatever the model."""
    if every == KVSettings.state_checkpoint_every or state_shape(config, torch.float32) is not None:
        return
    raise UserError(
        f"kv.state_checkpoint_every applies to models with linear-attention layers (Qwen3.5); "
        f"{model} has none: drop the setting"
    )


def check_draft_tokenizer(target: str, draft: str, trust_remote_code: bool = False) -> None:
    """decode.draft_model must exist and share the target's tokenizer (read from both folders:
    seconds, not the minutes a large target takes to load)."""
    toks = []
    for name, path in (("model", target), ("decode.draft_model", draft)):
        _check_path(path)
        try:
            toks.append(
                AutoTokenizer.from_pretrained(
                    path, trust_remote_code=trust_remote_code, local_files_only=local_files_only(path)
                )
            )
        except (OSError, ValueError) as err:
            raise UserError(f"cannot load the tokenizer of {name} {path!r}: {_load_error(err)}") from None
    check_same_tokenizer(*toks)


def speculative_from_cfg(cfg: DictConfig, lm: LoadedModel, method: str | None = None) -> Any:
    """decode.speculative (or ``method``) as a ``Speculative``, None when off; a draft model is
    loaded here (once per model: bench compares methods on one), on the target's device, so
    drafts never cross devices."""
    d = cfg.decode
    method = method or d.speculative
    if method == "none":
        return None
    draft = None
    if method == "draft":
        draft = load_model(
            str(d.draft_model),
            dtype=cfg.model.dtype,
            device_map=str(lm.device),
            quant=d.draft_quant,
            trust_remote_code=bool(cfg.model.trust_remote_code),
        )
        check_same_tokenizer(lm.tokenizer, draft.tokenizer)
    compile = compile_choice(d.draft_compile) is True  # auto: the draft decodes eagerly
    return Speculative(method, d.num_draft, d.ngram_max, d.ngram_min, draft=draft, compile=compile)


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
    check_stages(stages)
    return stages


def kv_memory(cfg: DictConfig) -> float | int | str:
    """kv.memory checked before the model loads (``kv.kv_memory_setting``)."""
    return kv_memory_setting(_plain(cfg.kv.memory))


def max_seqs(cfg: DictConfig) -> int | None:
    return cfg.engine.max_seqs


def engine_settings(cfg: DictConfig) -> dict:
    """The pool and engine settings (kv.*, engine.*) as Pipeline keyword arguments."""
    return dict(
        kv_memory=kv_memory(cfg),
        kv_block_size=cfg.kv.block_size,
        kv_state_checkpoint_every=cfg.kv.state_checkpoint_every,
        kv_attention=cfg.kv.attention,
        kv_dtype=cfg.kv.dtype,
        kv_offload=cfg.kv.offload,
        kv_offload_bytes=_plain(cfg.kv.offload_bytes),
        kv_offload_dir=cfg.kv.offload_dir,
        max_seqs=max_seqs(cfg),
        max_batch_tokens=cfg.engine.max_batch_tokens,
        burst=cfg.engine.burst,
    )


def pipeline_from_cfg(
    cfg: DictConfig,
    lm: LoadedModel,
    stages: dict[str, Any] | None = None,
    rows: int | None = None,
    wait: str = "never",
    said: bool = True,
    apart: bool = False,
) -> Pipeline:
    """The stage chain (``stages``, or built from cfg.stages) on the configured pool and engine.
    When its decode stage compiles (``decode.compile=true``, or ``stages.decode.compile`` set
    directly: the stage decides, so the two cannot disagree), or its draft model does
    (``decode.draft_compile``), or it replays CUDA graphs on a GPU (``decode.cuda_graphs``), it is
    warmed up here, before the first request, so TTFT never includes compiling or capturing.
    ``rows=1``: the caller decodes one sequence at a time (``Pipeline.warmup``).

    ``decode.compile=auto`` (the default) compiles beside the engine instead (``compile_ahead``):
    ``wait`` says when a caller waits for it: ``never``; ``cached``, when Inductor's caches hold
    it (a one-shot run); ``always`` (bench). ``said``: a line on stderr when a build beside the
    engine ends (not while a run streams its answer or a chat waits for input). ``apart``: a first
    compile not waited for runs in a process of its own (``Pipeline.compile_ahead``: a chat)."""
    stages = stages if stages is not None else stages_from_cfg(cfg)
    decode = stages.get("decode")
    if decode is not None and getattr(decode, "speculative", False) is None:  # a DecodeLoop not given one in Python
        decode.speculative = speculative_from_cfg(cfg, lm)
    pipe = Pipeline(lm, stages, **engine_settings(cfg))
    spec = getattr(decode, "speculative", None)
    compiled = getattr(decode, "compiled", None)
    if compiled is not None and getattr(compiled, "auto", False):
        compile_ahead(pipe, rows, wait, said, int(cfg.max_new_tokens), apart)
    if (compiled is not None and not getattr(compiled, "auto", False)) or getattr(spec, "compiled", None) is not None:
        print("mm-pipeline: warming up (compiling the decode step)...", file=sys.stderr)
        seconds = pipe.warmup(rows=rows)
        print(f"mm-pipeline: warm-up took {seconds:.1f} s (metrics warmup_s, not part of ttft_s)", file=sys.stderr)
    elif getattr(decode, "graphed", None) is not None and lm.device.type == "cuda":
        seconds = pipe.warmup()  # the first buckets' CUDA graphs, captured before the first request
        print(f"mm-pipeline: decode step captured as CUDA graphs in {seconds:.1f} s (warmup_s)", file=sys.stderr)
    return pipe


def compile_ahead(pipe: Pipeline, rows: int | None, wait: str, said: bool, tokens: int, apart: bool = False) -> None:
    """``decode.compile=auto``: the compiled step built beside the engine, or here when ``wait``
    says so (``pipeline_from_cfg``). A one-shot run (``cached``) waits for a cached compile
    where that is shorter than its answer of up to ``tokens`` would take eagerly
    (``Pipeline.compile_pays``); otherwise it answers eagerly at full speed, and a compile not
    cached yet is built after the answer (``finish_compile``): beside the answer, on 2 cores,
    the compile's Python slowed a 187M model's eager decode sevenfold."""
    if wait == "always" or (wait == "cached" and pipe.compile_pays(tokens, rows)):
        seconds = pipe.compile_ahead(rows, wait=True)
        if seconds is not None:
            print(f"mm-pipeline: {compiled_line(pipe, seconds)} (warmup_s, not in ttft_s)", file=sys.stderr)
    elif wait == "cached":
        pipe.compile_on_submit = False
        record = pipe.compile_record(rows)
        if "first_s" in record:  # cached, and its measured wait is longer than the answer
            print(
                f"mm-pipeline: decoding eagerly: the cached compile ({record['cached_s']:.1f} s) takes longer than "
                f"{tokens} tokens eagerly (decode.compile=true compiles anyway)",
                file=sys.stderr,
            )
    else:
        line = (lambda text: print(f"mm-pipeline: {text}", file=sys.stderr)) if said else None
        pipe.compile_ahead(rows, said=line, apart=apart)


def finish_compile(pipe: Pipeline, rows: int | None = None) -> None:
    """After a job's last answer: a ``decode.compile=auto`` step not built yet is built now, so
    that the next run of this model finds it in Inductor's caches and starts compiled; Ctrl-C
    skips it (the answers are already out). One that is cached already, or that failed here
    before (``inductor_cache.failed_before``), is left alone."""
    if not pipe.compile_pending or pipe.compile_cached(rows) or failed_before(pipe.compile_record(rows)):
        return
    print(
        "mm-pipeline: compiling the decode step, so that the next run starts compiled "
        "(once per model; Ctrl-C skips it; decode.compile=false turns it off)...",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    try:
        pipe.compile_ahead(rows, wait=True)
    except KeyboardInterrupt:
        print("mm-pipeline: compile skipped", file=sys.stderr)
        return
    print(f"mm-pipeline: {compiled_line(pipe, time.perf_counter() - t0)}", file=sys.stderr)


def compiled_line(pipe: Pipeline, seconds: float) -> str:
    """What a build that was waited for came to, in words."""
    failed = pipe.compile_failed
    return f"decode step compiled in {seconds:.1f} s" if failed is None else f"decode step not compiled ({failed})"


def input_paths(cfg: DictConfig) -> list[str]:
    value = _plain(cfg.get("input"))
    if value is None or value == "":
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


def request_from_cfg(cfg: DictConfig, **overrides: Any) -> Request:
    """The request the CLI settings describe; its media files are read here, before any model loads."""
    fps, max_frames = video_sampling(cfg)
    paths = input_paths(cfg)
    prompt = cfg.prompt
    if prompt is None and not paths and "prompt" not in overrides and not cfg.model.path:
        image, prompt = embedded_example()  # the first run shows the embedded default looking at an image
        paths = [image]
        print(f'mm-pipeline: no input given: asking "{prompt}" about the example image {image}', file=sys.stderr)
    media = Inputs()
    if paths:  # each file's kind by content; images and videos remember their file for messages
        media = load_inputs(paths, max_pixels=max_image_pixels(cfg), video_fps=fps, video_max_frames=max_frames)
    if prompt is None and not paths and "prompt" not in overrides:
        prompt = "Hello! Who are you?"
    stop = _plain(cfg.get("stop")) or []
    fields = dict(
        prompt=None if prompt is None else str(prompt),
        system_prompt=cfg.system_prompt,
        images=media.images,
        audios=media.audios,
        videos=media.videos,
        media_order=media.kinds or None,
        max_new_tokens=int(cfg.max_new_tokens),
        ignore_eos=bool(cfg.ignore_eos),
        stop=[stop] if isinstance(stop, str) else [str(s) for s in stop],
        thinking=cfg.thinking,
        adapter=cfg.get("adapter"),
        **cli_constraint(cfg.decode),
    )
    fields.update(overrides)
    request = Request(**fields)
    constraint_of(request, think=False)  # a bad output constraint stops here, before any model loads
    return request
