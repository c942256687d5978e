"""The settings' shape and rules, checked once where the configuration enters.

Two layers, so that no setting is checked twice or in the middle of a run:

- **types**: ``conf/config.yaml`` composes over ``Settings`` (dataclasses registered in Hydra's
  ConfigStore as ``mm_pipeline_schema``), so ``max_new_tokens=abc``, ``engine.burst=x`` or
  ``stream=maybe`` are refused while Hydra composes, before any code runs (``__main__`` turns
  that into one line);
- **rules** types cannot say (at least 1, min below max, a known scheme): ``check(cfg)``, called
  once by ``__main__`` before the mode starts. The code that builds objects from the config
  (``assemble``) then reads values it can trust.

The Python API has its own guards: a stage or ``Pipeline`` given a bad argument raises
``ValueError`` / ``TypeError`` (programming misuse); ``UserError`` is for what a CLI user can fix.
Mode-specific sections (``serve``, ``batch``, ``bench``, ``ceval``, ``eval``) are typed here and checked by
their mode when it starts, which is where they enter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline.errors import UserError, whole_number

SCHEMA = "mm_pipeline_schema"


@dataclass
class ModelSettings:
    name: Optional[str] = None
    path: Optional[str] = None
    dtype: str = "auto"
    device_map: Any = None  # auto, cpu, cuda:0, or {module: device}
    max_memory: Any = None  # {0: 10GiB, cpu: 30GiB}
    offload_folder: Optional[str] = None
    trust_remote_code: bool = False
    processor: Dict[str, Any] = field(default_factory=dict)
    tp: int = 1  # tensor-parallel ranks (torchrun --nproc-per-node N ... model.tp=N)
    lora: Any = None  # LoRA adapters: {name: folder or hub id} (checked by check_numbers)


@dataclass
class MediaSettings:
    max_image_pixels: int = 64_000_000
    long_audio: str = "split"  # split | error
    video_fps: float = 2.0
    video_max_frames: int = 64
    use_audio_in_video: bool = False  # hear a video's own audio track (Qwen2.5-Omni)


@dataclass
class DecodeSettings:
    compile: Any = "auto"  # true | false | auto (pipeline.runner.compiled.compile_choice)
    cuda_graphs: bool = True  # CUDA: the eager decode step replayed as CUDA graphs (pipeline.runner.graphs)
    matvec: bool = True  # CPU: the native kernels (one-row linear layers, decode attention; pipeline.runner.matvec)
    speculative: str = "none"  # none | ngram | draft
    num_draft: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    draft_model: Optional[str] = None
    draft_quant: str = "auto"
    draft_compile: Any = False  # true | false | auto (auto: the draft decodes eagerly)
    json_schema: Any = None  # output constraints (one at most): a .json file, inline JSON or a mapping
    regex: Optional[str] = None
    choice: Any = None  # a list of strings
    grammar: Optional[str] = None  # EBNF (xgrammar's dialect): text or a file


@dataclass
class KVSettings:
    memory: Any = "auto"  # bytes, "2GiB", a fraction of free memory, or auto
    block_size: int = 16
    state_checkpoint_every: int = 1024
    attention: str = "auto"  # auto | flex | sdpa
    dtype: str = "auto"  # auto | int8 | fp8
    offload: str = "none"  # none | host | disk
    offload_bytes: Optional[int] = None
    offload_dir: Optional[str] = None


@dataclass
class EngineSettings:
    max_seqs: Optional[int] = None
    max_batch_tokens: int = 2048
    burst: int = 8


@dataclass
class PrefillSettings:
    chunk_size: Optional[int] = None


@dataclass
class ModeSettings:
    name: str = "run"


@dataclass
class QuantSettings:
    name: str = "auto"
    quant_type: Optional[str] = None
    double_quant: Optional[bool] = None
    compute_dtype: Optional[str] = None
    threshold: Optional[float] = None
    skip_modules: Optional[List[str]] = None


@dataclass
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: Optional[str] = None
    api_key: Optional[str] = None
    allowed_media_dir: Optional[str] = None
    allow_remote_media: bool = False
    allowed_media_domains: List[str] = field(default_factory=list)
    max_body_bytes: int = 32 * 1024 * 1024
    max_images: int = 8
    max_audios: int = 4
    max_videos: int = 2
    max_audio_s: float = 600.0
    max_tokens: int = 8192
    max_n: int = 8
    drain_s: float = 30.0
    pooling: str = "last"
    max_waiting: Optional[int] = 256
    cors_origins: List[str] = field(default_factory=list)
    max_stored_responses: int = 1000
    runtime_lora: bool = True


@dataclass
class BatchSettings:
    shared_prefix: bool = False
    progress: bool = True
    sync_timeout_s: float = 86400.0
    logprobs: Optional[int] = None  # 0-20 top alternatives per generated token (the range: mode=batch)
    prompt_logprobs: Optional[int] = None
    logprobs_mode: str = "raw"  # raw | processed


@dataclass
class BenchSettings:
    # a length or a list of lengths (bench reads both)
    prompt_lengths: Any = field(default_factory=lambda: [32, 128])
    gen_lengths: Any = field(default_factory=lambda: [16, 64])
    batch_sizes: Any = field(default_factory=lambda: [1])
    repetitions: int = 3
    warmup: int = 1
    seed: int = 0
    baseline: Optional[str] = None
    speculative: Any = field(default_factory=lambda: ["none"])  # a method or a list: rows per decode.speculative


@dataclass
class CevalSettings:
    dev: Optional[str] = None
    shots: int = 5
    instruction: str = ""


@dataclass
class EvalSettings:
    tasks: Any = None  # lm-eval task or group names: a list, or one comma-separated string
    limit: Optional[float] = None  # documents per task (a whole number) or a fraction of each (0.1)
    num_fewshot: Optional[int] = None
    include_path: Optional[str] = None  # a folder of the user's own task YAMLs
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False
    log_samples: bool = False
    max_length: Optional[int] = None
    seed: int = 0
    adapter: Optional[str] = None  # score a model.lora adapter (null: the base model)


@dataclass
class Settings:
    """Every setting ``python -m pipeline`` reads; conf/config.yaml gives the defaults and comments."""

    model: ModelSettings = field(default_factory=ModelSettings)
    input: Any = None  # a path or a list of paths
    prompt: Optional[str] = None
    system_prompt: Optional[str] = None
    thinking: Optional[bool] = None
    adapter: Optional[str] = None  # a model.lora adapter's name: answer with it
    max_new_tokens: int = 64
    ignore_eos: bool = False
    stop: Any = field(default_factory=list)  # a string or a list of strings
    stream: bool = True
    metrics_table: bool = True
    media: MediaSettings = field(default_factory=MediaSettings)
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    kv: KVSettings = field(default_factory=KVSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    prefill: PrefillSettings = field(default_factory=PrefillSettings)
    stages: Any = None  # the chain: each stage's _target_ and arguments (instantiated by assemble)
    sampler: Any = None  # a Sampler's _target_ and arguments (users may point it at their own class)
    quant: QuantSettings = field(default_factory=QuantSettings)
    mode: ModeSettings = field(default_factory=ModeSettings)
    serve: Optional[ServeSettings] = None
    batch: Optional[BatchSettings] = None
    bench: Optional[BenchSettings] = None
    ceval: Optional[CevalSettings] = None
    eval: Optional[EvalSettings] = None
    data: Optional[str] = None  # mode=ceval: the questions
    dir: Optional[str] = None  # mode=report: the sweep folder


def register() -> None:
    """Make ``mm_pipeline_schema`` available to config.yaml's defaults list (idempotent)."""
    ConfigStore.instance().store(name=SCHEMA, node=Settings)


def plain(value: Any) -> Any:
    """An OmegaConf node as plain Python (dicts, lists), anything else unchanged."""
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def check(cfg: DictConfig) -> None:
    """The rules of the shared settings (types were checked while composing). Raises UserError."""
    check_numbers(cfg)
    # Imported here: the schema alone (Hydra's --help, --cfg, a composition error, the rules in
    # check_numbers) needs no torch or transformers, so those errors come in a second, not ten.
    from pipeline.kv import ATTENTION, kv_memory_setting
    from pipeline.kv.offload import Offload
    from pipeline.kv.quantised import kv_format
    from pipeline.model.loading import check_device_map, parse_max_memory
    from pipeline.media.video import check_sampling
    from pipeline.model.quant import SCHEMES, scheme_name
    from pipeline.spec import check_settings
    from pipeline.runner.compiled import compile_choice

    check_device_map(plain(cfg.model.device_map))  # devices that exist here, before any file is read
    parse_max_memory(plain(cfg.model.max_memory))
    media = cfg.media
    check_sampling(
        media.video_fps, media.video_max_frames, error=UserError, names=("media.video_fps", "media.video_max_frames")
    )
    kv_memory_setting(plain(cfg.kv.memory))
    if cfg.kv.attention not in ATTENTION:
        raise UserError(f"kv.attention must be one of {', '.join(ATTENTION)} (got {cfg.kv.attention!r})")
    kv_format(cfg.kv.dtype)
    Offload.checked(cfg.kv.offload, plain(cfg.kv.offload_bytes), cfg.kv.offload_dir)
    scheme_name(plain(cfg.quant))
    d = cfg.decode
    compile_choice(d.compile)
    compile_choice(d.draft_compile)
    check_settings(d.speculative, d.num_draft, d.ngram_max, d.ngram_min, has_draft=bool(d.draft_model))
    if d.draft_quant not in SCHEMES:
        raise UserError(f"unknown decode.draft_quant {d.draft_quant!r}: choose one of {', '.join(SCHEMES)}")


ADAPTER_MODES = ("run", "chat", "batch", "eval")  # the modes adapter= sets the answering adapter of


def check_adapter_settings(cfg: DictConfig) -> None:
    """``model.lora`` a mapping of names to sources; ``adapter=`` one of them, in a mode that uses it."""
    lora = plain(cfg.model.lora) or {}
    if not isinstance(lora, dict) or not all(isinstance(v, str) for v in lora.values()):
        raise UserError(f"model.lora must map names to adapter folders or hub ids: {{a: DIR}} (got {lora!r})")
    if cfg.adapter is None:
        return
    if cfg.mode.name not in ADAPTER_MODES:
        where = "a request names its adapter as model" if cfg.mode.name == "serve" else "give it in mode=run"
        raise UserError(f"adapter= is for mode={', '.join(ADAPTER_MODES)} (mode={cfg.mode.name}: {where})")
    if cfg.adapter not in lora:
        named = f"model.lora names {', '.join(sorted(lora))}" if lora else "model.lora is empty"
        raise UserError(f"adapter={cfg.adapter}: no such adapter ({named}; load one with model.lora={{NAME: DIR}})")


def check_numbers(cfg: DictConfig) -> None:
    """The rules ``check`` needs no other module for: counts, the prompt, pixel bounds."""
    whole_number("max_new_tokens", cfg.max_new_tokens)
    if cfg.prompt is not None and not str(cfg.prompt).strip():
        raise UserError("the prompt is empty: give prompt=TEXT")
    if cfg.model.name and not cfg.model.path:
        raise UserError(f"model {cfg.model.name!r} has no model.path: set model.path=DIR_OR_HUB_ID")
    check_adapter_settings(cfg)
    processor = {k: v for k, v in plain(cfg.model.processor).items() if v is not None}
    for key in ("min_pixels", "max_pixels"):
        if key in processor:
            whole_number(f"model.processor.{key}", processor[key])
    if processor.get("min_pixels", 0) > processor.get("max_pixels", float("inf")):
        raise UserError(
            f"model.processor.min_pixels ({processor['min_pixels']}) is above max_pixels ({processor['max_pixels']})"
        )
    if cfg.media.long_audio not in ("split", "error"):
        raise UserError(f"media.long_audio must be split or error (got {cfg.media.long_audio!r})")
    whole_number("media.max_image_pixels", cfg.media.max_image_pixels)
    whole_number("kv.block_size", cfg.kv.block_size)
    whole_number("kv.state_checkpoint_every", cfg.kv.state_checkpoint_every)
    for name in ("max_batch_tokens", "burst") + (("max_seqs",) if cfg.engine.max_seqs is not None else ()):
        whole_number(f"engine.{name}", cfg.engine[name])
    if cfg.prefill.chunk_size is not None:
        whole_number("prefill.chunk_size", cfg.prefill.chunk_size)
