"""Linear-attention (Gated DeltaNet) layers over a paged batch: each sequence on its own state.

The layer computation itself is the model's (its projections, ``conv1d`` weights, norm and the
module's own delta-rule functions); this file only feeds each sequence its own state slot
(``pipeline.kv.states``): decode rows together (one recurrent step, batched), prefill chunks one
by one (the chunked rule).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from pipeline.errors import UserError
from pipeline.kv import StateIO, StateShape, StateSlots
from pipeline.transfer import upload


@dataclass
class StateBatch:
    """The packed forward's state plan: decode rows batched, prefill chunks one by one."""

    slots: StateSlots
    decode_rows: torch.Tensor | None  # packed index of each one-token chunk
    decode_source: torch.Tensor | None
    decode_target: torch.Tensor | None
    chunks: list[tuple[int, int, StateIO]]  # (packed offset, count, io) of the longer chunks


def build_state_batch(slots: StateSlots, chunks: Sequence[Any], device: torch.device) -> StateBatch:
    """The plan for ``chunks`` (``batch.Chunk`` with ``state`` set by ``KVCache.reserve``)."""
    rows, sources, targets, longer, offset = [], [], [], [], 0
    for c in chunks:
        io: StateIO = c.state
        if c.count == 1 and not io.saves:
            rows.append(offset)
            sources.append(io.source)
            targets.append(io.target)
        else:
            longer.append((offset, c.count, io))
        offset += c.count

    def tensor(values: list[int]) -> torch.Tensor | None:
        return upload(values, device) if values else None

    return StateBatch(slots, tensor(rows), tensor(sources), tensor(targets), longer)


# --- the layer ----------------------------------------------------------------------------------
def _rules(module: torch.nn.Module) -> tuple[Any, Any]:
    """The model's own delta-rule functions (chunked, recurrent), from its modeling module: hub
    kernels registered for them there are used here too."""
    home = sys.modules[type(module).__module__]
    return home.torch_chunk_gated_delta_rule, home.torch_recurrent_gated_delta_rule


def linear_attention(module: torch.nn.Module, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
    """A Gated DeltaNet layer over the packed tokens of a paged batch, each sequence on its own
    state: the model's own arithmetic (as ``Qwen3_5GatedDeltaNet.forward`` with a cache), per
    sequence instead of per padded row."""
    states: StateBatch = batch.states
    conv_slab, matrix_slab = states.slots.layer(module.layer_idx)
    x = hidden[0]  # [T, hidden]
    tokens = x.shape[0]
    qkv = module.in_proj_qkv(x)  # [T, channels]
    z = module.in_proj_z(x)
    beta = module.in_proj_b(x).sigmoid()
    g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(x).float() + module.dt_bias)
    weight = module.conv1d.weight  # [channels, 1, kernel]
    chunked, recurrent = _rules(module)
    core = x.new_zeros(tokens, module.num_v_heads, module.head_v_dim)

    def mix(rows: Any, window: torch.Tensor, matrix: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolve ``window`` [B, channels, kernel - 1 + count], run the delta rule from ``matrix``;
        returns the new window tail and matrix, writing the outputs into ``core[rows]``."""
        mixed = F.conv1d(window.to(weight.dtype), weight, module.conv1d.bias, groups=window.shape[1])
        mixed = ACT2FN[module.activation](mixed).to(x.dtype).transpose(1, 2)  # [B, count, channels]
        q, k, v = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        b = q.shape[0]
        q = q.reshape(b, count, -1, module.head_k_dim)
        k = k.reshape(b, count, -1, module.head_k_dim)
        v = v.reshape(b, count, -1, module.head_v_dim)
        rule = recurrent if count == 1 else chunked
        out, matrix = rule(
            q,
            k,
            v,
            g=g[rows].view(b, count, -1),
            beta=beta[rows].view(b, count, -1),
            initial_state=matrix,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        core[rows] = out.reshape(b * count, *core.shape[1:])
        return window[..., -conv_slab.shape[-1] :], matrix

    if states.decode_rows is not None:
        rows = states.decode_rows
        window = torch.cat([conv_slab[states.decode_source], qkv[rows].unsqueeze(-1)], dim=-1)
        tail, matrix = mix(rows, window, matrix_slab[states.decode_source], 1)
        conv_slab.index_copy_(0, states.decode_target, tail.to(conv_slab.dtype))
        matrix_slab.index_copy_(0, states.decode_target, matrix.to(matrix_slab.dtype))
    for offset, count, io in states.chunks:
        tail, matrix = conv_slab[io.source : io.source + 1], matrix_slab[io.source : io.source + 1]
        begin = 0
        for end in sorted({*io.saves, count}):
            rows = slice(offset + begin, offset + end)
            window = torch.cat([tail, qkv[rows].T.unsqueeze(0)], dim=-1)
            tail, matrix = mix(rows, window, matrix, end - begin)
            for target in (io.saves.get(end), io.target if end == count else None):
                if target is not None:
                    conv_slab[target] = tail[0].to(conv_slab.dtype)
                    matrix_slab[target] = matrix[0].to(matrix_slab.dtype)
            begin = end
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, tokens, -1))


def _forward(
    module: torch.nn.Module, original: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    batch = kwargs.get("paged")
    if batch is None:
        return original(hidden_states, *args, **kwargs)
    return linear_attention(module, hidden_states, batch)


_REQUIRED = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")


def attach_linear(model: torch.nn.Module, shape: StateShape | None) -> None:
    """Route the linear-attention layers' paged forwards through ``linear_attention`` (other
    calls, e.g. ``generate()``, run the layer's own forward). Refuses, in one line, a model whose
    linear layers are not Gated DeltaNet as Qwen3.5 has them."""
    if shape is None:
        return
    found = []
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if layer in shape.layers and hasattr(module, "A_log"):
            missing = [name for name in _REQUIRED if not hasattr(module, name)]
            if missing:
                raise UserError(
                    f"linear-attention layers like {type(module).__name__} are not supported by the paged "
                    f"engine (no {', '.join(missing)}): only Gated DeltaNet as in Qwen3.5"
                )
            if not module.__dict__.get("_mm_linear"):
                # Under accelerate's hooks (device_map) wrap the inner forward, so they still run.
                name = "_old_forward" if hasattr(module, "_old_forward") else "forward"
                setattr(module, name, functools.partial(_forward, module, getattr(module, name)))
                module.__dict__["_mm_linear"] = True
            found.append(layer)
    if sorted(found) != sorted(shape.layers):
        raise UserError(
            f"the config names linear-attention layers {list(shape.layers)} but the model has Gated "
            f"DeltaNet modules at {sorted(found)}: the paged engine cannot run it"
        )
