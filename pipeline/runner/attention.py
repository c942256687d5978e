"""Paged attention: the model's attention layers read and write the KV pool in place.

Registered in transformers' attention-function registry (``mm_paged``): every linear layer sees
the packed tokens; attention writes each token's key/value into its slot and attends, per
sequence, over that sequence's blocks. Positions are passed explicitly, so Qwen2-VL's 3-D rope
rows and merged image/audio embeddings go through unchanged. Called on anything but a paged
batch, the function is the model's own attention (``generate()`` on the same model is
unaffected).

Why our own kernel-free attention instead of transformers' ``PagedAttentionCache``: that one
owns its scheduler state and knows neither 3-D positions nor ``inputs_embeds``; this file is
the few dozen lines that do, on plain ``scaled_dot_product_attention``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from pipeline.kv import state_shape
from pipeline.kv.quantised import LayerKV
from pipeline.memory import text_config
from pipeline.runner import flex, matvec
from pipeline.runner.paged_batch import Group, PagedBatch, key_slots
from pipeline.runner.decoder import plain_head
from pipeline.runner.linear import attach_linear
from pipeline.runner.masks import dense_mask

ATTENTION = "mm_paged"


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Write the packed tokens' keys/values into their slots, then attend per sequence.

    ``query`` [1, heads, T, D], ``key``/``value`` [1, kv_heads, T, D] (the new tokens only).
    A layer that passes ``sliding_window=W`` (transformers' attention modules do, None for full
    layers) attends with the batch's window masks. Anything but a paged batch goes to the
    model's own attention function.
    """
    batch: PagedBatch | None = kwargs.pop("paged", None)
    if batch is None:
        original = getattr(module.config, "_mm_paged_original", None) or "sdpa"
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(original, None) or eager_attention_forward
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    window = _check_layer(module, batch, kwargs)
    kv = batch.pool.layer(module.layer_idx)
    kv.write(batch.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    flat_q = query[0].transpose(0, 1)  # [T, heads, D]
    parts = [
        (
            g,
            _attend_causal(g, query, key, value, kv, scaling)
            if g.causal
            else _attend_alone(g, module, query, kv, scaling)
            if g.alone and (not native_decode(query, kv) or matvec.exact_bf16(query))
            else _attend(g, flat_q, kv, window is not None, scaling, batch.pool.block_size),
        )
        for g in batch.groups
    ]
    if len(parts) == 1 and parts[0][0].start == 0 and parts[0][1].shape[0] == flat_q.shape[0]:
        return parts[0][1].unsqueeze(0), None  # one contiguous group: already in packed order
    out = query.new_empty(flat_q.shape)
    for g, o in parts:
        if g.start is not None:
            out[g.start : g.start + o.shape[0]] = o
        else:
            out.index_copy_(0, g.dest, o.index_select(0, g.src))
    return out.unsqueeze(0), None


def _check_layer(module: torch.nn.Module, batch: PagedBatch, kwargs: dict) -> int | None:
    """The layer's sliding window (None: full attention), refusing what the pool cannot serve."""
    window = kwargs.get("sliding_window")
    if window is not None and window != batch.pool.window:
        raise ValueError(
            f"layer {module.layer_idx} attends with sliding_window={window} but the KV pool was built "
            f"for {batch.pool.window} (the config's layer types disagree with the model)"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("the paged attention has no logit soft-capping (this model's layers pass softcap)")
    return window


def _attend(
    g: Group, flat_q: torch.Tensor, kv: LayerKV, sliding: bool, scaling: float | None, block_size: int
) -> torch.Tensor:
    """One group's attention over its rows' blocks: [rows * q, heads, D] in row order
    (``sliding``: the layer has the pool's sliding window)."""
    rows, q = _sizes(g)
    heads, dim = flat_q.shape[1], flat_q.shape[2]
    if g.start is not None:
        qs = flat_q[g.start : g.start + rows * q].reshape(rows, q, heads, dim).transpose(1, 2)
    else:
        qs = flat_q[g.q_index].transpose(1, 2)  # [B, heads, q, D]
    if g.flex is not None:
        o = _attend_flex(g.flex, qs, kv, sliding, scaling, block_size)
        if o is not None:
            return o.transpose(1, 2).reshape(rows * q, heads, dim)
        k_slots, mask = _dense(g.flex, sliding, block_size)
    else:
        k_slots, mask = g.k_slots, g.window_mask if sliding else g.mask
    if g.q == 1 and kv.fmt is None and matvec.exact_bf16(qs):
        return torch.ops.mm_pipeline.rows_as_alone(qs[:, :, 0], kv.k, kv.v, k_slots, mask, scaling).reshape(
            rows * q, heads, dim
        )
    if g.q == 1 and native_decode(qs, kv):
        return torch.ops.mm_pipeline.decode_attention(
            qs[:, :, 0], kv.k, kv.v, k_slots, mask, dim**-0.5 if scaling is None else scaling
        )
    ks, vs = kv.gather(k_slots, qs.dtype)  # [B, kv_heads, K, D]
    kv_heads = ks.shape[1]
    if g.q == 1 and kv_heads != heads:
        # One query per row: the query heads sharing a key/value head become its rows (no
        # repeated keys, one mask for all of them).
        o = scaled_dot_product_attention(
            qs.reshape(rows, kv_heads, heads // kv_heads, dim), ks, vs, attn_mask=mask, scale=scaling
        )
        return o.reshape(rows * q, heads, dim)
    o = scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling, enable_gqa=kv_heads != heads)
    return o.transpose(1, 2).reshape(rows * q, heads, dim)


NATIVE_GROUP = 8  # the native decode kernel's most query heads per key/value head (decode_attention.cpp)


def native_decode(qs: torch.Tensor, kv: LayerKV) -> bool:
    """Whether decode rows attend through the native kernel (``decode_attention.cpp``): on CPU
    with the engine's native kernels on (``decode.matvec``), keys stored in the queries' dtype
    (float32 or bfloat16, not quantised). It reads the pool in place: no gathered copy."""
    return (
        qs.device.type == "cpu"
        and matvec.enabled()
        and kv.fmt is None
        and qs.dtype == kv.k.dtype
        and qs.dtype in (torch.float32, torch.bfloat16)
        and qs.shape[-1] % 8 == 0
        and qs.shape[1] // kv.k.shape[1] <= NATIVE_GROUP
    )


def _sizes(g: Group) -> tuple[Any, Any]:
    """(rows, queries per row), from the group's tensors where it has them: symbolic under
    torch.compile (a group without them is eager)."""
    if g.flex is not None:
        return g.flex.hi.shape[0], g.flex.hi.shape[1]
    if g.mask is not None:
        return g.mask.shape[0], g.mask.shape[2]
    return g.rows, g.q


def _attend_flex(
    masks: flex.PagedMasks, qs: torch.Tensor, kv: LayerKV, sliding: bool, scaling: float | None, block_size: int
) -> torch.Tensor | None:
    """[B, heads, q, D] by FlexAttention over the pool in place; None where it cannot run (keys
    stored in another dtype than the queries, or the kernel failed: said once, then never tried)."""
    k_pool, v_pool = kv.k, kv.v
    if qs.dtype != k_pool.dtype or flex.KERNEL.broken is not None:
        return None
    if torch.compiler.is_compiling():  # a failure here is the compiled step's to handle
        return flex.attend(qs, k_pool, v_pool, masks, sliding, scaling, block_size)
    try:
        return flex.attend(qs, k_pool, v_pool, masks, sliding, scaling, block_size)
    except Exception as err:  # dynamo/inductor raise many types; all mean "cannot compile this"
        flex.KERNEL.fail(err)
        return None


def _dense(masks: flex.PagedMasks, sliding: bool, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key slots [B, K], boolean mask [B, 1, q, K]): a FlexAttention group's masks as tensors,
    for SDPA over gathered keys."""
    slots = key_slots(masks.tables, block_size)
    return slots, dense_mask(slots.shape[1], masks.hi, masks.lo if sliding else None)


def _attend_alone(
    g: Group, module: torch.nn.Module, query: torch.Tensor, kv: LayerKV, scaling: float | None
) -> torch.Tensor:
    """A lone decode row over exactly its keys (``paged_batch.lone_decode``), no mask (every key is
    the row's own past), read in place where they are consecutive (``g.span``): [1, heads, D].

    With PyTorch's kernels (the native ones off) it is transformers' own SDPA call, the one
    ``generate()`` makes for a lone unpadded row, so the kernel sees the same shapes: in bfloat16
    the other form of this sum rounds otherwise at some lengths. With the native kernels on but
    their attention kernel unable to read this pool (``native_decode``: quantised keys, more than
    8 query heads to a key/value head) the step's linear layers round otherwise anyway, and the
    query heads sharing a key/value head go as the rows of one head: 2.5-2.7x quicker in float32,
    1.3-1.5x in bfloat16 (20 query heads on 4, 150-4,000 keys, 2 threads)."""
    ks, vs = kv.span(*g.span, query.dtype) if g.span is not None else kv.gather(g.k_slots, query.dtype)
    qs = query[:, :, g.start : g.start + 1]  # [1, heads, 1, D]
    if not matvec.enabled() or matvec.exact_bf16(qs):
        return sdpa_attention_forward(module, qs, ks, vs, None, scaling=scaling)[0][0]
    heads, kv_heads, dim = qs.shape[1], ks.shape[1], qs.shape[3]
    grouped = qs.reshape(1, kv_heads, heads // kv_heads, dim)
    return scaled_dot_product_attention(grouped, ks, vs, scale=scaling).reshape(1, heads, dim)


QUERY_TILE = 64  # CPU: rows of a chunk over cached keys attended at once (bounds the mask it needs)


def _attend_causal(
    g: Group, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv: LayerKV, scaling: float | None
) -> torch.Tensor:
    """One plainly causal prefill chunk (``batch.causal_chunk``): [q, heads, D].

    From position 0 its keys are its own new ones and the kernel is ``is_causal``, as
    ``generate()``'s (the same fused kernel, no mask). Over cached keys the mask is causality
    aligned to the bottom right: on CUDA SDPA takes it as a bias object (``causal_lower_right``)
    that its memory-efficient kernel applies without building it; on CPU no kernel does (the bias
    is materialised as a float [q, keys] tensor, 3.4x a boolean mask's bytes), so the queries go in
    tiles of ``QUERY_TILE`` rows, each with a boolean mask over the keys it can see."""
    q, first = g.q, g.start
    qs = query[:, :, first : first + q]
    gqa = key.shape[1] != query.shape[1]
    if g.span is None and g.k_slots is None:  # keys as the pool stores them: a prefix hit reads the same ones
        ks, vs = (kv.as_stored(t[:, :, first : first + q]) for t in (key, value))
        return scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=gqa)[0].transpose(
            0, 1
        )
    if g.span is not None:
        ks, vs = kv.span(*g.span, qs.dtype)
    else:
        ks, vs = kv.gather(g.k_slots, qs.dtype)
    if qs.device.type == "cuda":
        o = scaled_dot_product_attention(
            qs, ks, vs, attn_mask=causal_lower_right(q, ks.shape[2]), scale=scaling, enable_gqa=gqa
        )
        return o[0].transpose(0, 1)
    cached = ks.shape[2] - q
    parts = []
    for lo in range(0, q, QUERY_TILE):
        hi = min(q, lo + QUERY_TILE)
        seen = cached + hi
        rows = torch.arange(cached + lo, cached + hi, device=qs.device).unsqueeze(1)
        mask = torch.arange(seen, device=qs.device) <= rows  # [tile, seen]: causal
        parts.append(
            scaled_dot_product_attention(
                qs[:, :, lo:hi], ks[:, :, :seen], vs[:, :, :seen], attn_mask=mask, scale=scaling, enable_gqa=gqa
            )
        )
    return torch.cat(parts, dim=2)[0].transpose(0, 1)


AttentionInterface.register(ATTENTION, paged_attention)
AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def attach(model: torch.nn.Module) -> None:
    """Route the language model's attention through ``paged_attention`` (idempotent). Outside
    paged forwards it calls the implementation the model had, so nothing else changes."""
    text = text_config(model.config)
    current = text._attn_implementation
    if current != ATTENTION:
        text._mm_paged_original = current or "sdpa"
        text._attn_implementation = ATTENTION
    attach_linear(model, state_shape(model.config, torch.float32))
    model.__dict__["_mm_head"] = plain_head(model)
    model.__dict__["_mm_paged_attached"] = True  # forward checks this, not the (slow) config


def detach(model: torch.nn.Module) -> None:
    """Give the model back its own attention implementation (e.g. before transformers'
    ``generate_batch``, which accepts only its own); the next paged forward attaches again."""
    text = text_config(model.config)
    if text._attn_implementation == ATTENTION:
        text._attn_implementation = text._mm_paged_original
    model.__dict__.pop("_mm_paged_attached", None)
    model.__dict__.pop("_mm_head", None)
