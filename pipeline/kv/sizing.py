"""How big the KV pools are: ``kv.memory`` turned into blocks (and recurrent-state slots).

On a GPU the pools share the device with everything else a step needs, so ``auto`` first keeps
room for the activations of the largest step (measured by a pipeline's warm-up,
``pipeline.engine.headroom``; estimated from the configs otherwise, ``activation_headroom``), a draft model's pool is
sized with its target's from one budget (``pools_for``), and each CUDA pool is allocated as soon
as it is sized, so that free memory read afterwards sees it gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pipeline.errors import UserError, whole_number
from pipeline.kv.pool import BlockPool
from pipeline.kv.states import state_shape
from pipeline.memory import cache_devices, fmt_bytes, free_bytes, kv_bytes, kv_shape, text_config

AUTO_CUDA_SHARE = 0.8  # of what is free once the activation headroom is kept
AUTO_CPU_SHARE, AUTO_CPU_CAP = 0.25, 2 << 30  # of available RAM (pages are touched only as blocks are used)
# ``auto`` on CPU below the cap, rounded down to a multiple of this: a run sized from what RAM is
# free at its start gets the same pool as the run before it, so the compiled decode step (whose
# graphs have the pool's shape) is found in Inductor's caches instead of compiled again
AUTO_CPU_STEP = 256 << 20

# Whether a prefill step's attention may build [heads, chunk, context] float32 score matrices:
# counted in the headroom. A lone plainly causal chunk takes a fused kernel (no mask, no scores:
# runner.attention._attend_causal), but several prompts' chunks in one step, windows and
# bidirectional image blocks still attend with an explicit mask, which on CUDA with grouped-query
# heads falls to the math kernel. A fused paged kernel for those too would set this False.
PREFILL_SCORE_MATRICES = True


def kv_memory_setting(value: Any) -> float | int | str:
    """``kv.memory`` checked: ``auto`` (also None), a number of bytes, or a fraction in (0, 1]."""
    if value is None or value == "auto":
        return "auto"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value <= 0
        or (isinstance(value, float) and value > 1)
    ):
        raise UserError(f"kv.memory must be auto, a number of bytes, or a fraction in (0, 1] (got {value!r})")
    return value


@dataclass(frozen=True)
class Budget:
    """The bytes ``kv.memory`` gives the pools together, how to name that ask in messages, and
    what ``auto`` kept out of it for activations (bytes, and what they are for)."""

    nbytes: int
    asked: str
    reserved: int = 0
    why: str = ""


@dataclass
class Pools:
    """Pools sized together from one budget: the target's first, then a draft model's."""

    pools: list[BlockPool]
    models: list[Any]
    budget: Budget

    def describe(self) -> str:
        """One line for the run's report: each pool's size and tokens, and where the budget
        came from (what ``auto`` kept for activations, and why)."""
        names = ["kv pool", "draft kv pool"]
        parts = [
            f"{names[min(i, 1)]} {fmt_bytes(p.num_blocks * p.block_bytes)}"
            f"{'' if p.kv_dtype == 'auto' else f' {p.kv_dtype}'} "
            f"({p.capacity_tokens:,} tokens in blocks of {p.block_size}"
            f"{f', on each of {p.shards} tensor-parallel ranks' if p.shards > 1 else ''})"
            for i, p in enumerate(self.pools)
        ]
        tier = self.pools[0].tier
        kept = "" if tier is None else f"; {describe_tier(tier)}"
        return f"{' + '.join(parts)}: {self.budget.asked}{kept}"


def describe_tier(tier: Any) -> str:
    """The second tier in a few words: kind, bound, blocks held (and a disk tier's folder)."""
    s = tier.stats()
    where = f" in {tier.folder}" if s["tier"] == "disk" else ""
    return f"{s['tier']} tier{where}, at most {fmt_bytes(s['max_bytes'])}, {s['blocks']:,} blocks held"


def pool_for(
    lm: Any,
    memory: float | int | str | None = None,
    block_size: int = 16,
    checkpoint_every: int = 1024,
    max_seqs: int = 8,
    max_batch_tokens: int = 2048,
    kv_dtype: str = "auto",
) -> BlockPool:
    """A pool sized by ``memory`` (``kv_memory_setting``): bytes, a fraction of what is free now,
    or ``auto``: 80% of free CUDA memory once the activations of a ``max_batch_tokens`` prefill
    and of the largest image are kept free (``activation_headroom``), or on CPU 25% of available
    RAM up to 2 GiB (blocks are touched only as they are first used, so an unused part costs
    nothing). Free memory honours ``model.max_memory``; a pool that does not fit, or has no room
    for one block, is refused with the numbers.

    A model with linear-attention layers also gets recurrent-state slots out of the same bytes
    (``state_budget``): two per sequence in flight (``max_seqs``: its state and the one a forward
    writes) plus one checkpoint per ``checkpoint_every`` tokens the blocks hold. ``kv_dtype``:
    ``kv.dtype`` (quantised keys and values: ``pipeline.kv.quantised``).
    """
    return pools_for([lm], memory, block_size, checkpoint_every, max_seqs, max_batch_tokens, kv_dtype=kv_dtype).pools[0]


def pools_for(
    models: Sequence[Any],
    memory: float | int | str | None = None,
    block_size: int = 16,
    checkpoint_every: int = 1024,
    max_seqs: int = 8,
    max_batch_tokens: int = 2048,
    headroom: tuple[int, str] | None = None,
    kv_dtype: str = "auto",
) -> Pools:
    """One pool per model (a target, then its draft model) from one ``memory`` budget measured on
    the first model's device, split by their KV bytes per token so that every pool holds the
    same number of tokens (a draft drafts over the sequences its target holds).

    Why together: sized one after the other before either is allocated, both would claim 80% of
    the same free memory, and the first draft forward would run out of it.

    ``headroom``: (bytes, what for) kept free under ``auto`` on CUDA, as measured by a warm-up
    run (``pipeline.engine.headroom``); without it, ``activation_headroom`` estimates it from the configs.
    """
    memory = kv_memory_setting(memory)
    block_size = whole_number("kv.block_size", block_size)
    checkpoint_every = whole_number("kv.state_checkpoint_every", checkpoint_every)
    target = models[0]
    device = pool_device(target)
    reserved, why = (0, "")
    if memory == "auto" and device.type == "cuda":
        reserved, why = headroom or activation_headroom(target, max_batch_tokens, max_seqs)
    budget = _budget(memory, device, target, reserved, why)
    rates = [bytes_per_token(lm, block_size, checkpoint_every, kv_dtype) for lm in models]
    pools = []
    for i, (lm, rate) in enumerate(zip(models, rates)):
        asked = budget.asked if i == 0 else f"the draft model's share of {budget.asked}"
        pools.append(
            _pool(lm, int(budget.nbytes * rate / sum(rates)), asked, block_size, checkpoint_every, max_seqs, kv_dtype)
        )
    return Pools(pools, list(models), budget)


def shards(lm: Any) -> int:
    """The tensor-parallel ranks ``lm``'s weights (and so its KV heads) are split over."""
    return int(getattr(lm, "tp", 1))


def pool_device(lm: Any) -> torch.device:
    """The device whose free memory sizes the pool: the first GPU a decoder layer computes on,
    else the first layer's device."""
    devices = cache_devices(lm)
    return next((d for d in devices if d.type == "cuda"), devices[0] if devices else torch.device("cpu"))


def pool_bytes_for(
    lm: Any, tokens: int, block_size: int, checkpoint_every: int, max_seqs: int, kv_dtype: str = "auto"
) -> int:
    """Bytes of ``memory`` that give a pool room for ``tokens`` tokens (and, for models with
    recurrent states, the slots ``state_budget`` sets aside first): ``pools_for``'s inverse."""
    nbytes = -(-tokens // block_size) * kv_bytes(lm.config, block_size, _kv_dtype(lm), shards(lm), kv_dtype)
    shape = state_shape(lm.config, _kv_dtype(lm))
    if shape is not None:
        nbytes += (4 * max_seqs + tokens // checkpoint_every + 1) * shape.slot_bytes
    return nbytes


def bytes_per_token(lm: Any, block_size: int, checkpoint_every: int, kv_dtype: str = "auto") -> float:
    """Pool bytes one token costs this model: its keys and values, plus its share of a
    recurrent-state checkpoint for models with linear-attention layers (kept in the model's dtype)."""
    dtype = _kv_dtype(lm)
    rate = kv_bytes(lm.config, block_size, dtype, shards(lm), kv_dtype) / block_size
    shape = state_shape(lm.config, dtype)
    return rate + (shape.slot_bytes / checkpoint_every if shape is not None else 0.0)


def _pool(
    lm: Any, nbytes: int, asked: str, block_size: int, checkpoint_every: int, max_seqs: int, kv_dtype: str = "auto"
) -> BlockPool:
    """A pool of ``nbytes`` for ``lm``, allocated now when it lives on a GPU."""
    dtype = _kv_dtype(lm)
    block_bytes = kv_bytes(lm.config, block_size, dtype, shards(lm), kv_dtype)
    shape = state_shape(lm.config, dtype)
    if shape is None:
        blocks, slots, reserved = nbytes // block_bytes, 0, 0
    else:
        if checkpoint_every % block_size:
            raise UserError(
                f"kv.state_checkpoint_every ({checkpoint_every}) must be a multiple of kv.block_size "
                f"({block_size}): checkpoints at block boundaries serve the prefix cache"
            )
        blocks, slots, reserved = state_budget(
            nbytes, block_bytes, block_size, shape.slot_bytes, checkpoint_every, max_seqs
        )
    if blocks < 1:
        states = f" after {slots} recurrent-state slots ({fmt_bytes(slots * shape.slot_bytes)})" if slots else ""
        raise UserError(
            f"{asked} gives {fmt_bytes(nbytes)}: not even one KV block of {block_size} tokens "
            f"({block_bytes:,} bytes){states}: raise kv.memory or model.max_memory"
        )
    devices = cache_devices(lm)
    pool = BlockPool(
        lm.config,
        blocks + 1,
        block_size,
        dtype,
        devices,  # + the null block
        state_slots=slots + 1 if slots else 0,
        checkpoint_every=checkpoint_every,
        reserved_slots=reserved,
        shards=shards(lm),
        kv_dtype=kv_dtype,
    )
    if any(torch.device(d).type == "cuda" for d in devices):
        pool.prepare_write()  # allocated now: memory read after this (a draft's pool, the next job) sees it gone
    return pool


def _budget(memory: float | int | str, device: torch.device, lm: Any, reserved: int = 0, why: str = "") -> Budget:
    """The bytes ``kv.memory`` asks for on ``device`` (``reserved``: kept free first under
    ``auto``, for ``why``), and how to name the ask in a message."""
    free, source = free_bytes(device, lm)
    if memory == "auto":
        if device.type == "cuda":
            kept = f", after keeping {fmt_bytes(reserved)} for activations: {why}" if reserved else ""
            return Budget(
                int(AUTO_CUDA_SHARE * max(free - reserved, 0)),
                f"kv.memory=auto (80% of {fmt_bytes(free)} free, {source}{kept})",
                reserved,
                why,
            )
        share = min(int(AUTO_CPU_SHARE * free), AUTO_CPU_CAP)
        return Budget(
            share - share % AUTO_CPU_STEP if share >= AUTO_CPU_STEP else share,
            f"kv.memory=auto (25% of {fmt_bytes(free)} free, {source}, at most {fmt_bytes(AUTO_CPU_CAP)}, "
            f"in steps of {fmt_bytes(AUTO_CPU_STEP)})",
        )
    if isinstance(memory, float):
        return Budget(int(memory * free), f"kv.memory={memory} of {fmt_bytes(free)} free ({source})")
    asked = f"kv.memory={int(memory):,} bytes"
    if memory > free:
        raise UserError(
            f"{asked} is more than the {fmt_bytes(free)} ({free:,} bytes) free on {device} ({source}): lower kv.memory"
        )
    return Budget(int(memory), asked)


def activation_headroom(lm: Any, tokens: int, rows: int) -> tuple[int, str]:
    """(bytes, what for) to keep free besides the pool: a full ``tokens``-token prefill step
    with ``rows`` logits rows (``prefill_activation_bytes``) plus the vision encoder on its
    largest input (``vision_activation_bytes``), both estimated from the configs before any
    request runs. Counted together: the encoded image waits in memory for its prefill."""
    dtype = _kv_dtype(lm)
    text = prefill_activation_bytes(lm.config, tokens, dtype, rows)
    why = f"a {tokens:,}-token prefill ({fmt_bytes(text)})"
    patches = largest_image_patches(lm)
    vision = vision_activation_bytes(lm.config, patches, dtype)
    if vision:
        why += f" and the largest image, {patches:,} patches, through the vision encoder ({fmt_bytes(vision)})"
    return text + vision, why


def prefill_activation_bytes(
    config: Any, tokens: int, dtype: torch.dtype, rows: int, score_matrices: bool = PREFILL_SCORE_MATRICES
) -> int:
    """Peak bytes one decoder layer's forward holds for ``tokens`` packed tokens, besides weights
    and pool: the residual stream and its normed copies, queries/keys/values, the keys and
    values a chunk's attention gathers (repeated to every query head), the MLP's gate, up and
    product, float32 score matrices and their softmax when ``score_matrices``, and ``rows``
    float32 logits rows over the vocabulary. An estimate (layers run one at a time, so one
    layer's worth), on the generous side."""
    text = text_config(config)
    size = torch.empty((), dtype=dtype).element_size()
    _, kv_heads, head_dim = kv_shape(config)
    heads = int(text.num_attention_heads)
    hidden = int(text.hidden_size)
    inter = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    per_token = (4 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim + 3 * inter) * size
    scores = 2 * heads * tokens * tokens * 4 if score_matrices else 0
    logits = rows * int(text.vocab_size) * 4
    return tokens * per_token + scores + logits


def vision_activation_bytes(config: Any, patches: int, dtype: torch.dtype) -> int:
    """Peak bytes the vision encoder holds for ``patches`` patches of one image: the input
    pixels (float32), the residual stream and its normed copies, queries/keys/values and the
    MLP's hidden layer (its attention runs fused, with no mask). 0 without a vision tower."""
    vision = getattr(config, "vision_config", None)
    if vision is None or patches <= 0:
        return 0
    size = torch.empty((), dtype=dtype).element_size()
    width = int(getattr(vision, "embed_dim", None) or vision.hidden_size)
    inter = int(getattr(vision, "intermediate_size", None) or getattr(vision, "mlp_ratio", 4) * width)
    patch = int(getattr(vision, "patch_size", 14))
    pixels = int(getattr(vision, "in_channels", 3)) * int(getattr(vision, "temporal_patch_size", 1)) * patch * patch
    return patches * (pixels * 4 + (4 * width + 3 * width + 2 * inter) * size)


def largest_image_patches(lm: Any) -> int:
    """Patches the vision encoder sees for the largest image the processor lets through (its
    pixels, ``largest_image_pixels``, over the patch area). 0 without an image processor."""
    vision = getattr(lm.config, "vision_config", None)
    proc = getattr(getattr(lm, "processor", None), "image_processor", None)
    if vision is None or proc is None:
        return 0
    patch = int(getattr(proc, "patch_size", None) or getattr(vision, "patch_size", 14))
    return largest_image_pixels(lm) // (patch * patch)


def largest_image_pixels(lm: Any) -> int:
    """Pixels of the largest image the processor lets through: its pixel cap (Qwen-style
    ``max_pixels``/``longest_edge`` counts pixels) or fixed size. 0 when it has neither."""
    proc = getattr(getattr(lm, "processor", None), "image_processor", None)
    size = getattr(proc, "size", None) or {}

    def get(key: str) -> Any:
        return size.get(key) if hasattr(size, "get") else getattr(size, key, None)

    pixels = getattr(proc, "max_pixels", None) or get("max_pixels")
    if not pixels and getattr(proc, "merge_size", None):  # Qwen processors keep max_pixels as longest_edge
        pixels = get("longest_edge")
    if not pixels and get("height") and get("width"):
        pixels = int(get("height")) * int(get("width"))
    return int(pixels or 0)


def state_budget(
    nbytes: int, block_bytes: int, block_size: int, slot_bytes: int, checkpoint_every: int, max_seqs: int
) -> tuple[int, int, int]:
    """(KV blocks, state slots, slots reserved for live states) that fit in ``nbytes``: each
    sequence in flight needs two slots; checkpoints get one slot per ``checkpoint_every`` tokens
    of blocks, and at least two per sequence (its prompt's end and last block boundary)."""
    live = 2 * max_seqs
    per_token = block_bytes / block_size + slot_bytes / checkpoint_every
    tokens = max(0, nbytes - (live + 2 * max_seqs) * slot_bytes) / per_token
    checkpoints = max(2 * max_seqs, -(-int(tokens) // checkpoint_every))
    blocks = int((nbytes - (live + checkpoints) * slot_bytes) // block_bytes)
    return max(blocks, 0), live + checkpoints, live


def _kv_dtype(lm: Any) -> torch.dtype:
    """Keys and values come out in the compute dtype (bf16/fp16 under 4-bit weights too)."""
    dtype = getattr(lm.model, "dtype", torch.float32)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        dtype = torch.float32
    quant = getattr(getattr(lm.model, "config", None), "quantization_config", None)
    compute = getattr(quant, "bnb_4bit_compute_dtype", None)
    return compute if isinstance(compute, torch.dtype) else dtype
