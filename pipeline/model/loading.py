"""load_model: a hub id or a local save_pretrained directory, through transformers + accelerate."""

from __future__ import annotations

import functools
import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate.utils import convert_file_size_to_int
from huggingface_hub import HfApi, constants as hub_constants, try_to_load_from_cache
from huggingface_hub.errors import HfHubHTTPError
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

from pipeline.model import quant as q, tensor_parallel
from pipeline.model.lora import Adapter, Adapters
from pipeline.errors import UserError
from pipeline.families import Family, family_for_config
from pipeline.kv import state_shape
from pipeline.memory import fmt_bytes, stored_bytes, text_config
from pipeline.tiny import MARKER_FILE, model_card


@dataclass
class LoadedModel:
    """A model with what the stages need next to it: tokenizer, processor, family, placement."""

    model: Any
    tokenizer: Any
    processor: Any | None
    family: Family
    path: str
    quant: str = "none"  # the scheme in force, read from the loaded layers (nf4, fp4, int8, none)
    quant_note: str = ""  # how quant=auto decided (for the weights line); empty for an explicit scheme
    placement: dict = field(default_factory=dict)  # device -> {dtype/quant: bytes}
    max_memory: dict = field(default_factory=dict)  # model.max_memory in bytes: budgets the KV guard honours
    # media kind -> the question a model built by the project asks when media come without a
    # prompt (the trained embedded default's "What shapes are in the image?"); empty otherwise
    default_prompts: dict = field(default_factory=dict)
    tp: int = 1  # tensor-parallel ranks its weights are sharded over (``pipeline.model.tensor_parallel``)
    adapters: Adapters = field(default_factory=Adapters)  # LoRA adapters beside it, by name (pipeline.model.lora)
    # How ``load_model`` loaded the weights: {"auto_class", "kwargs" of from_pretrained}, so that a
    # process of its own loads them alike (``pipeline.runner.compile_apart``); empty: not repeatable
    source: dict = field(default_factory=dict)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def template_owner(self) -> Any:
        """What renders the chat template: the processor (multimodal models), else the tokenizer."""
        return self.processor if self.processor is not None else self.tokenizer

    @functools.cached_property
    def recurrent(self) -> bool:
        """Has linear-attention layers (per-sequence recurrent states, ``pipeline.kv.states``):
        such models decode step by step, eagerly, without speculation."""
        return state_shape(self.config, torch.float32) is not None

    def load_adapter(self, name: str, source: str, base: str | None = None) -> Adapter:
        """Read a peft LoRA adapter (a folder or a hub id) and keep it beside this model by name
        (``base``: the base model's served name, which it may not take); ``UserError`` in one line
        when it cannot serve."""
        return self.adapters.load(name, source, self.model, tp=self.tp, base=base)

    @property
    def weights_bytes(self) -> int:
        return sum(sum(kinds.values()) for kinds in self.placement.values())

    @property
    def eos_token_ids(self) -> set[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return set()
        return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def resolve_dtype(dtype: str | torch.dtype | None, device_map: Any, config: Any = None) -> torch.dtype | str:
    """ "auto" follows the checkpoint, as transformers 5 does, where that computes fast: bfloat16 on
    a GPU; on CPU a bfloat16 checkpoint (``config``'s dtype) in bfloat16 where the CPU has it
    natively (AVX512-BF16 or AMX: ``cpu_has_bf16``), float32 otherwise (exact, and faster than
    bf16 emulated). Without ``config``: float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if q.on_gpu(device_map):
            return torch.bfloat16
        return torch.bfloat16 if checkpoint_dtype(config) == torch.bfloat16 and cpu_has_bf16() else torch.float32
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise UserError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return value


def checkpoint_dtype(config: Any) -> torch.dtype | None:
    """The dtype a checkpoint's weights were saved in (``config.json``'s ``dtype``, ``torch_dtype``
    before transformers 5; a multimodal model's text model's where the top level has none)."""
    for part in (config, getattr(config, "text_config", None)):
        named = getattr(part, "dtype", None) or getattr(part, "torch_dtype", None)
        if not isinstance(named, torch.dtype):
            named = getattr(torch, str(named or "").removeprefix("torch."), None)
        if isinstance(named, torch.dtype):
            return named
    return None


def cpu_has_bf16() -> bool:
    """Whether this CPU has bfloat16 instructions (AVX512-BF16 or AMX tiles); oneDNN's bfloat16
    path (``runner.packed.native_bf16``) also runs, emulated, on AVX-512 CPUs without them."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # (torch.cpu's, private)
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def _check_path(path: str) -> None:
    """Local directories are checked here; anything shaped like org/name goes to the hub, which
    must answer when the id is not in the local cache (``check_hub_reachable``)."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise UserError(f"model.path {path!r} is a file: give the directory written by save_pretrained")
        if not (p / "config.json").is_file():
            raise UserError(f"model.path {path!r} has no config.json: not a save_pretrained directory")
    elif not _HUB_ID.match(path) or path.startswith("."):
        raise UserError(f"model.path {path!r} does not exist")
    else:
        check_hub_reachable(path)


HUB_PROBE_TIMEOUT_S = 5.0


def check_hub_reachable(repo_id: str) -> None:
    """A hub id must be downloadable or already in the local Hugging Face cache.

    Why: without network, huggingface_hub retries each missing file five times with backoff
    (about 30 s and two dozen warning lines) before transformers gives up; one probe of the hub
    (``hub_unreachable``) turns that into one line at once. With ``HF_HUB_OFFLINE=1`` the cache
    alone answers, at once, so nothing is probed.
    """
    if hub_constants.HF_HUB_OFFLINE:
        return
    reason = hub_unreachable(repo_id)
    if reason is None or _cached(repo_id):
        return
    raise UserError(
        f"cannot reach the Hugging Face hub to fetch {repo_id!r} (no network? {reason}): download it "
        "elsewhere and pass model.path=DIR, or set HF_HUB_OFFLINE=1 to use the local cache only"
    )


def local_files_only(path: str) -> bool:
    """Whether ``from_pretrained`` must read ``path`` from the local cache alone: a hub id that is
    cached but whose hub does not answer.

    Why: offline, transformers still asks the hub about each file of a cached model (and lists
    its chat templates), each request retried five times: a cached 3 MiB model took 7 minutes to
    load. Reachable hubs keep the normal path (updates are fetched).
    """
    if hub_constants.HF_HUB_OFFLINE or Path(path).expanduser().exists() or not _HUB_ID.match(path):
        return False
    return hub_unreachable(path) is not None and _cached(path)


def _cached(repo_id: str) -> bool:
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


@functools.cache  # one probe per id and process
def hub_unreachable(repo_id: str) -> str | None:
    """Ask the hub about ``repo_id`` once, with a short timeout and no retries: None when it
    answers (also with an error such as no such repo or gated, which ``from_pretrained`` then
    names), else why it did not (DNS, refused, timeout) in a few words."""
    try:
        HfApi().model_info(repo_id, timeout=HUB_PROBE_TIMEOUT_S)
    except (HfHubHTTPError, ValueError):  # the hub answered (404, 401, 5xx) or the id is malformed
        return None
    except Exception as err:
        if not _no_answer(err):
            raise
        return " ".join(str(err).split())[:120] or type(err).__name__
    return None


def _no_answer(err: BaseException) -> bool:
    """A transport failure (DNS, refused, timeout, proxy): OSError, or the ``TransportError`` of
    whichever httpx huggingface_hub is built on (``httpx`` in 1.x, ``httpx2`` in 2.x)."""
    return isinstance(err, OSError) or any(cls.__name__ == "TransportError" for cls in type(err).__mro__)


def read_config(path: str, trust_remote_code: bool = False) -> Any:
    """The model's config.json alone (``AutoConfig``): milliseconds, so what depends on the model
    (``pipeline.cli.assemble.check_settings_for_model``) is refused before minutes of loading weights."""
    _check_path(path)
    try:
        return AutoConfig.from_pretrained(
            path, trust_remote_code=trust_remote_code, local_files_only=local_files_only(path)
        )
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load model {path!r}: {_load_error(err)}") from None


def _device_name(device: Any) -> str:
    """accelerate writes GPUs as ints; report them the way torch names them."""
    if isinstance(device, int):
        return f"cuda:{device}"
    return str(device)


def _mapped_device(name: str, device_map: dict) -> str | None:
    """The device ``hf_device_map`` gives the longest module prefix of parameter ``name``."""
    best, best_len = None, -1
    for prefix, device in device_map.items():
        if (prefix == "" or name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
            best, best_len = device, len(prefix)
    return None if best is None else _device_name(best)


def _tensor_bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _storage(tensor: torch.Tensor) -> tuple[str, int]:
    """(kind, bytes) of one parameter: its dtype, or its bitsandbytes scheme with the scales.

    Params4bit holds two 4-bit weights per uint8 plus a QuantState (absmax per block, and
    with double quant the absmax of the absmax); Int8Params holds int8 weights plus one
    float scale per row (SCB). The scales are part of what the scheme costs, so they count.
    """
    cls = type(tensor).__name__
    if cls == "DTensor":  # tensor parallel: what this rank holds of it
        tensor = tensor.to_local()
        cls = type(tensor).__name__
    nbytes = _tensor_bytes(tensor)
    if cls == "Params4bit":
        state = getattr(tensor, "quant_state", None)
        if state is not None:
            nbytes += _tensor_bytes(getattr(state, "absmax", None)) + _tensor_bytes(getattr(state, "code", None))
            nested = getattr(state, "state2", None)
            if nested is not None:
                nbytes += _tensor_bytes(getattr(nested, "absmax", None)) + _tensor_bytes(getattr(nested, "code", None))
        return str(getattr(tensor, "quant_type", None) or "4bit"), nbytes
    if cls == "Int8Params":
        return "int8", nbytes + _tensor_bytes(getattr(tensor, "SCB", None))
    if cls in q.TORCHAO_TENSORS:  # a tensor subclass: its packed data and scales are inner tensors
        return q.TORCHAO_TENSORS[cls], stored_bytes(tensor)
    return str(tensor.dtype).replace("torch.", ""), nbytes


def placement_of(model: Any) -> dict[str, dict[str, int]]:
    """Bytes of weights per device and per dtype / quantisation scheme (under tensor parallel,
    this rank's shards).

    Weights accelerate offloaded sit on the ``meta`` device in the model; they are counted
    where they really live (``cpu`` or ``disk``, from ``hf_device_map``), at their size.
    """
    device_map = getattr(model, "hf_device_map", None) or {}
    out: dict[str, dict[str, int]] = {}
    seen: set[int] = set()
    named = list(model.named_parameters(remove_duplicate=True)) + list(model.named_buffers(remove_duplicate=True))
    for name, tensor in named:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        kind, nbytes = _storage(tensor)
        dev = str(tensor.device)
        if tensor.device.type == "meta":
            dev = _mapped_device(name, device_map) or "meta"
        kinds = out.setdefault(dev, {})
        kinds[kind] = kinds.get(kind, 0) + nbytes
    return out


def format_placement(placement: dict[str, dict[str, int]]) -> str:
    """One line per device, e.g. ``cpu: nf4 1.2 MiB, float32 3.4 MiB`` (for stderr)."""
    lines = []
    for dev, kinds in placement.items():
        parts = ", ".join(f"{kind} {_mib(n)}" for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
        lines.append(f"{dev}: {parts} (total {_mib(sum(kinds.values()))})")
    return "\n".join(lines)


def weights_line(lm: LoadedModel) -> str:
    """The weights line a run prints to stderr: the scheme in force, how quant=auto chose it, and
    the bytes per device, and each LoRA adapter's rank and bytes."""
    note = f" {lm.quant_note}" if lm.quant_note else ""
    line = f"weights (quant={lm.quant}):{note}\n{format_placement(lm.placement)}"
    adapters = [f"{a.name} (rank {a.rank}, {a.nbytes / 2**20:.2f} MiB)" for a in lm.adapters.loaded()]
    return line + (f"\nLoRA adapters: {', '.join(adapters)}" if adapters else "")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


_NAMED_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def _check_device(device: Any, what: str) -> None:
    """A device_map value: an int GPU index, cpu, disk, cuda[:N], mps; CUDA only where there is one."""
    if isinstance(device, int) and not isinstance(device, bool):
        name = _device_name(device)
    elif isinstance(device, str):
        name = device
    else:
        raise UserError(f"{what} {device!r} is not a device: use cpu, disk, cuda, cuda:N or a GPU index")
    if name == "disk":
        return
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"{what} {device!r} is not a device: use cpu, disk, cuda, cuda:N or a GPU index") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{what} {device!r} needs a CUDA GPU and none is available: use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"{what} {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")


def check_device_map(device_map: Any) -> Any:
    """Validate model.device_map: None, auto/balanced/sequential, one device, or {module: device}."""
    if device_map is None or device_map in _NAMED_MAPS:
        return device_map
    if isinstance(device_map, dict):
        if not device_map:
            raise UserError("model.device_map is an empty mapping: give {module: device} or auto")
        for module, device in device_map.items():
            _check_device(device, f"model.device_map[{module!r}]")
        return device_map
    _check_device(device_map, "model.device_map")
    return device_map


def parse_max_memory(max_memory: Any) -> dict:
    """model.max_memory -> {0: bytes, "cpu": bytes}; sizes like 10GiB, 500MB or plain bytes."""
    if not max_memory:
        return {}
    if not isinstance(max_memory, dict):
        raise UserError(f"model.max_memory must be a mapping like {{0: 10GiB, cpu: 30GiB}} (got {max_memory!r})")
    out: dict = {}
    written: dict = {}  # the sizes as the user wrote them, for the message
    for key, size in max_memory.items():
        if isinstance(key, str) and re.fullmatch(r"(cuda:)?\d+", key):
            key = int(key.split(":")[-1])
        if not (isinstance(key, int) or key in ("cpu", "disk", "mps")):
            raise UserError(f"model.max_memory key {key!r} is not a device: use a GPU index, cpu, disk or mps")
        try:
            value = convert_file_size_to_int(size)
        except (ValueError, AttributeError, TypeError):
            value = -1
        if value < 0:
            raise UserError(f"model.max_memory[{key!r}]={size!r} is not a size: write it like 10GiB, 500MB or bytes")
        out[key], written[key] = value, size
    _check_budget_devices(written)
    return out


def _check_budget_devices(budgets: dict) -> None:
    """Every GPU index in model.max_memory must exist here.

    Why: accelerate places layers on a GPU index it is given whether or not CUDA exists, and
    the load then dies deep in transformers (``Found no NVIDIA driver``, a traceback) after the
    processor and part of the weights were read; docs/quantisation.md's ``{0: 10GiB, cpu: 30GiB}`` on a
    machine without CUDA must be one line naming the fix.
    """
    gpus = sorted(k for k in budgets if isinstance(k, int))
    if not gpus:
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [i for i in gpus if i >= count]
    if not missing:
        return
    rest = {k: v for k, v in budgets.items() if not isinstance(k, int) or k < count}
    keep = (
        ("use {" + ", ".join(f"{k}: {v}" for k, v in rest.items()) + "} or drop model.max_memory")
        if rest
        else "drop model.max_memory"
    )
    names = ("devices " if len(missing) > 1 else "device ") + ", ".join(str(i) for i in missing)
    where = "no CUDA device is available" if count == 0 else f"only {count} CUDA device(s) are here (0-{count - 1})"
    raise UserError(f"model.max_memory names CUDA {names} but {where}: {keep}")


def check_offload_folder(folder: str | None) -> str | None:
    """Create model.offload_folder now and prove it is writable, before minutes of loading."""
    if not folder:
        return None
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".mm-pipeline-write-test-"):
            pass
    except OSError as err:
        raise UserError(f"model.offload_folder {folder!r} cannot be written: {err.strerror or err}") from None
    return str(path)


def _is_tiny(path: str) -> bool:
    """A model this project built (random or toy weights): quant=auto leaves it unquantised."""
    return (Path(path).expanduser() / MARKER_FILE).is_file()


def _default_prompts(path: str) -> dict[str, str]:
    """The questions a project-built model asks of media given without a prompt (its marker's
    ``default_prompts``): the toy shapes model was trained on one question, not "Describe this image."."""
    prompts = (model_card(path) or {}).get("default_prompts") or {}
    return {str(kind): str(text) for kind, text in prompts.items()} if isinstance(prompts, dict) else {}


def _tied_lm_head(config: Any) -> bool:
    text = text_config(config)
    return bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))


def _has_accelerator(device_map: Any) -> bool:
    values = device_map.values() if isinstance(device_map, dict) else [device_map]
    return torch.cuda.is_available() and any(v not in ("cpu", "disk") for v in values)


AUTO_BF16_SHARE = 0.5  # quant=auto keeps 16-bit weights that take at most this share of the GPU


def accelerator_memory(device_map: Any, budgets: dict) -> tuple[str, int] | None:
    """(name, bytes) of the GPU memory the weights would load into: the total of the GPUs
    ``device_map`` may use (all of them for auto/balanced/sequential, the first otherwise), each
    capped by its ``model.max_memory`` budget; None when the model computes on the CPU."""
    if not q.on_gpu(device_map):
        return None
    if isinstance(device_map, dict):
        named = [torch.device(_device_name(d)) for d in device_map.values() if d not in ("cpu", "disk")]
        indices = sorted({d.index or 0 for d in named})
    elif device_map in _NAMED_MAPS:
        indices = list(range(torch.cuda.device_count()))
    elif device_map is None:
        indices = [torch.cuda.current_device()]
    else:
        indices = [torch.device(_device_name(device_map)).index or 0]
    total = sum(min(int(torch.cuda.get_device_properties(i).total_memory), budgets.get(i, 1 << 62)) for i in indices)
    return ", ".join(f"cuda:{i}" for i in indices), total


def estimated_weights_bytes(path: str, config: Any, dtype: torch.dtype) -> int:
    """The weights' bytes once loaded in ``dtype``, known before loading: the checkpoint's
    safetensors (local files, or the cached index of a hub id) rescaled from the checkpoint's
    dtype, else the language model's parameters counted from its config."""
    stored = _checkpoint_bytes(path)
    size = torch.empty((), dtype=dtype).element_size()
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    saved = getattr(torch, saved, None) if isinstance(saved, str) else saved
    saved_size = torch.empty((), dtype=saved).element_size() if isinstance(saved, torch.dtype) else 2
    if stored:
        return stored * size // saved_size
    return _config_parameters(config) * size


def _checkpoint_bytes(path: str) -> int:
    """Bytes of the checkpoint's safetensors files (0 when they cannot be known without a download)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return sum(f.stat().st_size for f in local.glob("*.safetensors"))
    index = try_to_load_from_cache(path, "model.safetensors.index.json")
    if isinstance(index, str):
        return int(json.loads(Path(index).read_text()).get("metadata", {}).get("total_size", 0))
    single = try_to_load_from_cache(path, "model.safetensors")
    return Path(single).stat().st_size if isinstance(single, str) else 0


def _config_parameters(config: Any) -> int:
    """The language model's parameters from its sizes (embeddings, attention, MLP, lm_head)."""
    text = text_config(config)
    hidden, layers = int(text.hidden_size), int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    inter = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter
    return int(text.vocab_size) * hidden * (1 if _tied_lm_head(config) else 2) + layers * per_layer


def auto_scheme(path: str, config: Any, dtype: torch.dtype, device_map: Any, budgets: dict) -> tuple[str, str]:
    """``quant=auto`` for this model and device, and why in words (the weights line says it).

    On a GPU, decode reads every weight each step: 16-bit weights that fit comfortably (at most
    half the GPU's memory, the rest for the KV cache and activations) stay 16-bit, exact and
    fast; larger ones load in nf4 (about 3.5x fewer bytes). On CPU, weight-only int8 (torchao,
    one scale per row) with the native one-row kernel is the fastest scheme measured
    (``benchmarks/quant_speed.py``: 2.4-2.9x float32, 1.5-1.8x bfloat16 single-stream decode; the
    engine's tokens equal ``generate()`` on the same weights); without the kernel torchao
    dequantises in every matmul, so the weights stay as they are. Models built by this project
    are test scaffolding, kept exact; an already quantised checkpoint keeps its own scheme.
    """
    if getattr(config, "quantization_config", None) is not None:
        return "none", "quant=auto: the checkpoint is already quantised; its own scheme is kept"
    if _is_tiny(path):
        return "none", "quant=auto: none for a model built by this project"
    gpu = accelerator_memory(device_map, budgets)
    if gpu is None:
        from pipeline.runner import matvec

        why_not = matvec.load()
        if why_not is not None:
            return (
                "none",
                f"quant=auto: none on CPU (no native kernel: {why_not}; int8 would dequantise in every matmul)",
            )
        return "int8wo", (
            "quant=auto chose int8wo on CPU: int8 weights, one scale per row, read by the native "
            "kernel (2.4-2.9x float32, 1.5-1.8x bfloat16 single-stream decode)"
        )
    name, total = gpu
    weights = estimated_weights_bytes(path, config, dtype)
    kind = str(dtype).removeprefix("torch.")
    if weights <= AUTO_BF16_SHARE * total:
        return "none", (
            f"quant=auto kept {kind}: the weights (about {fmt_bytes(weights)}) take at most half of "
            f"{name}'s {fmt_bytes(total)}"
        )
    return "nf4", (
        f"quant=auto chose nf4: the weights (about {fmt_bytes(weights)} in {kind}) take more than half of "
        f"{name}'s {fmt_bytes(total)}"
    )


def resolve_auto(
    path: str, config: Any, dtype: torch.dtype, device_map: Any, budgets: dict, tp: int = 1, auto_keeps: str = ""
) -> tuple[str, str]:
    """``quant=auto`` for this run: ``auto_scheme``'s choice, the same under tensor parallel as in one
    process (int8wo is sharded over the ranks), except where a run must keep the checkpoint's weights
    (``auto_keeps``: mode=eval measures the model) or the choice cannot be sharded (bitsandbytes)."""
    if auto_keeps:
        return "none", f"quant=auto keeps the checkpoint's weights under {auto_keeps}"
    scheme, note = auto_scheme(path, config, dtype, device_map, budgets)
    if tp > 1 and scheme in tensor_parallel.BITSANDBYTES:
        return "none", (
            f"quant=auto keeps the checkpoint's weights under model.tp={tp}: it would choose {scheme} "
            "in one process, and bitsandbytes weights cannot be sharded"
        )
    if tp > 1 and scheme != "none":
        note += f"; sharded over the {tp} tensor-parallel ranks"
    return scheme, note


def _quantization(
    quant: Any,
    config: Any,
    path: str,
    torch_dtype: Any,
    device_map: Any,
    family: Family,
    budgets: dict,
    tp: int = 1,
    auto_keeps: str = "",
) -> tuple[Any, str]:
    """quant (a scheme name or the quant config group) -> (BitsAndBytesConfig / TorchAoConfig or
    None, how ``auto`` decided: empty for an explicit scheme)."""
    quant_cfg = {"name": quant} if isinstance(quant, str) else quant
    scheme, note = q.scheme_name(quant_cfg), ""
    if scheme == "auto":
        dtype = torch_dtype if isinstance(torch_dtype, torch.dtype) else torch.bfloat16
        scheme, note = resolve_auto(path, config, dtype, device_map, budgets, tp, auto_keeps)
        quant_cfg = {**quant_cfg, "name": scheme}
    if scheme == "none":
        return None, note
    if not torch.cuda.is_available() and isinstance(device_map, dict) and "disk" in device_map.values():
        raise UserError(
            f"quant={scheme} cannot offload layers to disk without a CUDA GPU (bitsandbytes keeps offloaded "
            "layers unquantised next to a GPU): drop 'disk' from model.device_map or use quant=none"
        )
    # An explicit map that puts some modules on cpu/disk next to a GPU: those stay unquantised
    # (bitsandbytes' documented offload). With "auto" transformers decides too late for that,
    # so a quantised model that does not fit fails with a one-line error instead.
    explicit_offload = isinstance(device_map, dict) and bool({"cpu", "disk"} & set(device_map.values()))
    return q.quantization_config(
        quant_cfg,
        model_dtype=torch_dtype if isinstance(torch_dtype, torch.dtype) else torch.float32,
        tied_lm_head=_tied_lm_head(config),
        cpu_offload=explicit_offload and _has_accelerator(device_map),
        encoders=family.encoder_modules,
        unquantised=family.unquantised_modules,
        gpu=q.on_gpu(device_map),
    ), note


def load_model(
    path: str,
    *,
    dtype: str | torch.dtype | None = "auto",
    device_map: Any = None,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
    quant: Any = None,
    quantization_config: Any = None,
    trust_remote_code: bool = False,
    processor_kwargs: dict | None = None,
    config: Any = None,
    tp: int = 1,
    auto_keeps: str = "",
) -> LoadedModel:
    """Load weights, tokenizer/processor and the family; bad paths become one-line UserErrors.

    ``quant``: a scheme name (``"nf4"``, ``"int8"``, ...) or the ``quant`` config group;
    ``quantization_config``: a ready transformers config instead (then ``quant`` is ignored).
    ``max_memory`` without ``device_map`` means ``device_map="auto"`` (a budget only
    accelerate's placement can honour). The KV guard before prefill also reads it. ``config``:
    the model's config when the caller read it already (``read_config``), not read again.
    ``tp``: shard the weights over this many ranks of a ``torchrun`` launch (transformers'
    tensor-parallel plan; ``pipeline.model.tensor_parallel``), refused in one line where it cannot work;
    int8wo is quantised per shard with the rows' scales of the whole weight, so the ranks hold what
    one process would (``tensor_parallel.quantize_shards``).
    ``auto_keeps``: why this run keeps the checkpoint's weights under ``quant=auto`` (the weights
    line says it), e.g. ``"mode=eval"``; empty: ``auto`` picks the fastest exact scheme.
    """
    path = str(path)
    _check_path(path)
    device_map = check_device_map(device_map)
    budgets = parse_max_memory(max_memory)
    if budgets and device_map is None:
        device_map = "auto"
    offload_folder = check_offload_folder(offload_folder)
    config = config if config is not None else read_config(path, trust_remote_code)
    family = family_for_config(config)
    torch_dtype = resolve_dtype(dtype, device_map, config)
    quant_note = ""
    if tp > 1:
        _check_tensor_parallel(config, tp, quant, device_map)
    if quantization_config is None and quant is not None:
        quantization_config, quant_note = _quantization(
            quant, config, path, torch_dtype, device_map, family, budgets, tp, auto_keeps
        )
    shard_quantised = tensor_parallel.quantised_after_sharding(quantization_config) if tp > 1 else None
    if shard_quantised is not None:
        quantization_config = None  # loaded in full precision, sharded, then quantised per shard below
    hub: dict[str, Any] = {"trust_remote_code": trust_remote_code, "local_files_only": local_files_only(path)}
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "use_safetensors": True, **hub}
    if tp > 1:  # the architecture's own plan, over the launch's ranks
        kwargs.update(
            distributed_config=tensor_parallel.distributed_config(tp, config),
            config=tensor_parallel.plan_config(config),
        )
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif quantization_config is not None and tp == 1 and torch.cuda.is_available():
        # Quantised weights are made where they load: bitsandbytes picks the GPU itself, torchao
        # would quantise on (and stay on) the CPU, where its int4 packing does not even exist.
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    if budgets:
        kwargs["max_memory"] = dict(budgets)
    if offload_folder:
        kwargs["offload_folder"] = offload_folder
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    # Tokenizer / processor first: a directory without them fails before the weights load.
    processor = None
    try:
        if family.uses_processor:
            processor = AutoProcessor.from_pretrained(path, **hub, **(processor_kwargs or {}))
            tokenizer = processor.tokenizer
        else:
            tokenizer = AutoTokenizer.from_pretrained(path, **hub)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load the tokenizer/processor of {path!r}: {_load_error(err)}") from None
    auto_class = getattr(transformers, family.auto_class)
    try:
        with tensor_parallel.sharding_within_groups(tensor_parallel.current() if tp > 1 else None):
            model = auto_class.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load model {path!r}: {_load_error(err)}") from None
    if shard_quantised is not None:
        tensor_parallel.quantize_shards(model, shard_quantised, tensor_parallel.current())
    if device_map is None and torch.cuda.is_available() and quantization_config is None and tp == 1:
        model.to("cuda")
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        processor=processor,
        family=family,
        path=path,
        quant=q.scheme_in_force(model),
        quant_note=quant_note,
        placement=placement_of(model),
        max_memory=budgets,
        default_prompts=_default_prompts(path),
        tp=tp,
        source={"auto_class": family.auto_class, "kwargs": kwargs} if tp == 1 else {},
    )


def _check_tensor_parallel(config: Any, tp: int, quant: Any, device_map: Any) -> None:
    """Refuse what cannot be sharded (before any weight loads), then join the launch's group."""
    tensor_parallel.check_launch(tp)
    if device_map is not None:
        raise UserError(
            f"model.tp={tp} places the weights itself (one shard per rank): drop model.device_map / model.max_memory"
        )
    quant_cfg = {"name": quant} if isinstance(quant, str) else quant
    scheme = q.scheme_name(quant_cfg) if quant_cfg is not None else "none"
    tensor_parallel.check_model(config, tp, scheme, state_shape(config, torch.float32) is not None)
    tensor_parallel.start(tp)


def _load_error(err: Exception) -> str:
    """transformers' offload errors are paragraphs; say in one line what to change."""
    text = str(err)
    if "offload_folder" in text or "offloaded to the disk" in text:
        return (
            "some weights do not fit in memory and go to disk: set model.offload_folder=DIR (or raise model.max_memory)"
        )
    if "dispatched on the CPU or the disk" in text:
        return (
            "the quantised model does not fit in model.max_memory and bitsandbytes cannot offload quantised "
            "layers to cpu/disk: raise model.max_memory, give an explicit model.device_map, or use quant=none"
        )
    return text.strip().splitlines()[0] if text.strip() else type(err).__name__
