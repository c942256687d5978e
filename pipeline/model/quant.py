"""Weight quantisation (bitsandbytes, torchao) from the ``quant`` config group: which scheme, and what it skips.

Schemes: ``none``, ``nf4`` and ``fp4`` (4-bit weights, ``bnb.nn.Linear4bit``), ``int8``
(LLM.int8, ``bnb.nn.Linear8bitLt``), ``int8wo`` and ``int4wo`` (torchao's weight-only int8 and
int4 tensors, through transformers' ``TorchAoConfig``: plain ``nn.Linear`` modules whose weight
dequantises inside the matmul, which ``torch.compile`` fuses; one-row steps on CPU read the int8
data directly: ``pipeline.runner.matvec``) and ``auto`` (resolved per run by the model and
device: ``pipeline.model.loading.auto_scheme``).
The scheme a run reports (``result.json`` ``metrics.quant``) is read back from the loaded
modules (``scheme_in_force``), never copied from the request, so a sweep compares what
really ran.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, Sequence

import torch
from transformers import BitsAndBytesConfig

from pipeline.errors import UserError

SCHEMES = ("none", "auto", "nf4", "fp4", "int8", "int8wo", "int4wo")
FOUR_BIT = ("nf4", "fp4")
TORCHAO = ("int8wo", "int4wo")
# torchao's weight tensor classes -> the scheme they are (scheme_in_force, the weights line)
TORCHAO_TENSORS = {
    "Int8Tensor": "int8wo",
    "Int4Tensor": "int4wo",
    "Int4TilePackedTo4dTensor": "int4wo",
    "Int4PreshuffledTensor": "int4wo",
    "Int4PlainInt32Tensor": "int4wo",
}


class _DropMessages(logging.Filter):
    """Drops bitsandbytes log lines that are expected on this path and would only alarm users."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


@functools.cache
def quiet_bitsandbytes() -> None:
    """Silence two bitsandbytes warnings that fire on every CPU run and change nothing.

    Why: the CPU backend logs that an optional ``kernels`` package is missing (it falls back
    to its own kernel), and LLM.int8 logs on *every matmul* that float32 inputs are cast to
    float16 (that cast is how int8 works). Other bitsandbytes messages stay. Called before
    anything imports bitsandbytes (peft does, for its quantised LoRA layers): the first line
    fires at import.
    """
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropMessages("Failed to load CPU gemm_4bit"))
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(_DropMessages("MatMul8bitLt: inputs will be cast"))


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """``key`` of a mapping (dict, DictConfig) or an attribute-style config; None reads as empty."""
    if cfg is None:
        return default
    return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)


def on_gpu(device_map: Any) -> bool:
    """Will the model compute on a CUDA GPU: one is available and device_map does not pin it to cpu."""
    return torch.cuda.is_available() and device_map not in ("cpu", {"": "cpu"})


def scheme_name(quant_cfg: Any) -> str:
    """The requested scheme, checked: one of SCHEMES, and quant_type not naming another scheme."""
    name = str(_get(quant_cfg, "name", "none") or "none")
    if name not in SCHEMES:
        raise UserError(f"unknown quant scheme {name!r}: choose one of {', '.join(SCHEMES)}")
    qtype = _get(quant_cfg, "quant_type")
    if qtype is None:
        return name
    qtype = str(qtype)
    if qtype not in FOUR_BIT:
        raise UserError(f"unknown quant.quant_type {qtype!r}: the 4-bit storage types are nf4 and fp4")
    if name in ("int8", *TORCHAO):
        raise UserError(
            f"quant={name} with quant.quant_type={qtype}: {name} and {qtype} are two different schemes and a model "
            f"uses one; choose quant={name} or quant={qtype}"
        )
    if name in ("none", "auto"):
        raise UserError(f"quant.quant_type={qtype} needs a 4-bit scheme: use quant={qtype} (quant is {name})")
    if qtype != name:
        raise UserError(f"quant={name} with quant.quant_type={qtype} contradict each other: use quant={qtype}")
    return name


def skip_patterns(names: Any, *, keep_lm_head: bool = False, always: Sequence[str] = ()) -> list[str]:
    """Module names -> patterns transformers matches at a module boundary anywhere in the path.

    transformers matches ``llm_int8_skip_modules`` from the start of the full module name
    (``model.visual.blocks.0...``), so a bare ``visual`` would never match; we anchor each
    name after any dotted prefix instead. Passing a list *replaces* transformers' own
    default skips (the output embedding and tied weights), hence ``keep_lm_head``;
    ``always``: names added whatever ``names`` says (``Family.unquantised_modules``).
    """
    if names is None:
        names = []
    if isinstance(names, str):
        names = [names]
    try:
        names = [str(n) for n in names]
    except TypeError:
        raise UserError(f"quant.skip_modules must be a list of module names (got {names!r})") from None
    for n in names:
        if not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", n):
            raise UserError(f"quant.skip_modules entry {n!r} is not a module name (like lm_head or model.visual)")
    if keep_lm_head and "lm_head" not in names:
        names.append("lm_head")
    names.extend(always)
    return [rf"(?:.*\.)?{re.escape(n)}" for n in dict.fromkeys(names)]


def compute_dtype(value: Any, model_dtype: torch.dtype) -> torch.dtype:
    """``auto`` = the model's dtype (``model.dtype``): activations stay in it."""
    if value in (None, "auto"):
        return model_dtype
    if isinstance(value, torch.dtype):
        return value
    dt = getattr(torch, str(value), None)
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise UserError(f"unknown quant.compute_dtype {value!r}: use auto, float32, bfloat16 or float16")
    return dt


def quantization_config(
    quant_cfg: Any,
    *,
    model_dtype: torch.dtype = torch.float32,
    tied_lm_head: bool = False,
    cpu_offload: bool = False,
    encoders: Sequence[str] = (),
    unquantised: Sequence[str] = (),
    gpu: bool = False,
) -> Any:
    """A ``transformers.BitsAndBytesConfig`` for a resolved scheme (nf4, fp4 or int8), or a
    ``TorchAoConfig`` (int8wo, int4wo; ``gpu``: the model computes on a CUDA GPU).

    ``tied_lm_head``: the output layer shares the embedding matrix, which must stay a plain
    tensor, so ``lm_head`` is kept unquantised whatever the skip list says.
    ``cpu_offload``: layers accelerate places on the CPU or disk next to a GPU stay
    unquantised in the model dtype (bitsandbytes' documented way to offload).
    ``encoders``: the family's encoder modules (``Family.encoder_modules``), which a skip list
    left at null keeps unquantised, along with lm_head except under int8wo (``default_skips``).
    ``unquantised``: the family's ``unquantised_modules``, kept unquantised whatever the skip
    list says (layers bitsandbytes cannot pack, such as Gated DeltaNet's one-output-per-head
    projections: its CPU 4-bit kernel needs out_features divisible by 32).
    """
    name = scheme_name(quant_cfg)
    if name in ("none", "auto"):
        raise UserError(f"quant={name} has no bitsandbytes config (resolve the scheme first)")
    names = _get(quant_cfg, "skip_modules", None)
    skips = skip_patterns(
        default_skips(name, encoders) if names is None else names, keep_lm_head=tied_lm_head, always=unquantised
    )
    if name in TORCHAO:
        return torchao_config(name, skips, gpu, cpu_offload)
    quiet_bitsandbytes()
    if name == "int8":
        threshold = _get(quant_cfg, "threshold", 6.0)
        try:
            threshold = float(6.0 if threshold is None else threshold)
        except (TypeError, ValueError):
            raise UserError(f"quant.threshold must be a number (got {threshold!r})") from None
        return BitsAndBytesConfig(
            load_in_8bit=True,
            llm_int8_threshold=threshold,
            llm_int8_skip_modules=skips,
            llm_int8_enable_fp32_cpu_offload=cpu_offload,
        )
    double = _get(quant_cfg, "double_quant", True)
    if not isinstance(double, bool) and double is not None:
        raise UserError(f"quant.double_quant must be true or false (got {double!r})")
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=name,
        bnb_4bit_use_double_quant=bool(double) if double is not None else True,
        bnb_4bit_compute_dtype=compute_dtype(_get(quant_cfg, "compute_dtype", "auto"), model_dtype),
        llm_int8_skip_modules=skips,
        llm_int8_enable_fp32_cpu_offload=cpu_offload,
    )


def default_skips(name: str, encoders: Sequence[str]) -> list[str]:
    """What ``quant.skip_modules: null`` keeps unquantised: the media encoders, and the output
    projection except under int8wo. That projection is a third of a small model's decode bytes
    (65 of 189 MB a token on the 187M Llama: int8wo 1.30x bfloat16 with it kept, 1.78x with it
    int8, ``benchmarks/quant_speed.py``) and int8 rounds each weight to within 0.4% of its row's
    largest, so int8wo quantises it as llama.cpp's q8_0 does; the other schemes keep it, as
    transformers does. A tied projection is the input embedding and stays plain either way
    (``tied_lm_head``)."""
    return list(encoders) if name == "int8wo" else ["lm_head", *encoders]


def torchao_config(name: str, skips: list[str], gpu: bool, cpu_offload: bool) -> Any:
    """transformers' ``TorchAoConfig`` for int8wo (int8 weights, one scale per output row) or
    int4wo (int4 weights, one scale and zero point per 128 inputs; CUDA kernels only)."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    except ImportError:
        raise UserError(f"quant={name} needs torchao: pip install torchao") from None
    from transformers import TorchAoConfig

    if name == "int4wo" and not gpu:
        raise UserError(
            "quant=int4wo needs a CUDA GPU: torchao's int4 kernels are CUDA-only (its generic CPU int4 "
            "path measured about 5x slower than bfloat16 here); on CPU use quant=int8wo"
        )
    if cpu_offload:
        raise UserError(
            f"quant={name} cannot offload layers to cpu or disk next to a GPU: give the model the whole "
            "GPU (model.device_map=auto with enough memory) or use quant=nf4"
        )
    # int4: the tile-packed layout runs on PyTorch's own tinygemm kernel (``_weight_int4pack_mm``);
    # torchao's default "plain" layout needs the separate mslk kernel library.
    scheme = (
        Int8WeightOnlyConfig()
        if name == "int8wo"
        else Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    )
    return TorchAoConfig(quant_type=scheme, modules_to_not_convert=skips)


def scheme_in_force(model: Any) -> str:
    """What the loaded model really runs: nf4 / fp4 / int8 from its bnb layers, else none.

    Mixed 4-bit types (only possible with a hand-made checkpoint) read as ``nf4+fp4``.
    """
    found: list[str] = []
    for module in model.modules():
        cls = type(module).__name__
        if cls in ("Linear4bit", "LinearFP4", "LinearNF4"):
            qtype = getattr(module.weight, "quant_type", None) or getattr(module, "quant_type", None) or "nf4"
            found.append(str(qtype))
        elif cls == "Linear8bitLt":
            found.append("int8")
        elif type(getattr(module, "weight", None)).__name__ in TORCHAO_TENSORS:
            found.append(TORCHAO_TENSORS[type(module.weight).__name__])
    return "+".join(sorted(set(found))) if found else "none"
