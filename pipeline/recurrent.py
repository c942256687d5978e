"""Linear-attention (Gated DeltaNet) layers in the paged engine: recurrent states in pool slots.

Qwen3.5 mixes full-attention layers with Gated DeltaNet layers. Those keep no keys and values:
a sequence's past is a fixed-size **state** per layer (the causal convolution's last inputs and
the delta rule's matrix), the same size at any length. A state cannot be cropped, so every
cache operation that goes back in time (rollback, /undo, snapshots, a prefix shared with an
earlier request) needs the state *as it was* at that position: a **checkpoint**.

The pool keeps states the way it keeps KV blocks (``StateSlots``): a fixed number of slots
sized from ``kv.memory``, reference-counted, slot 0 the all-zero state of an empty sequence
(never written, like the null block). A forward never writes a state in place: each sequence
reads its current slot and writes a fresh one, so a checkpoint is just one more reference to a
slot (taking one at the end of a chunk copies nothing), a fork shares its parent's slots, and a
failed forward leaves the old state intact. Checkpoints inside a chunk (every
``kv.state_checkpoint_every`` tokens, the end of a shared prefix) split the chunk there and
write their own slots. Checkpoints at block boundaries are also registered under the block's
prefix-cache hash, so a later request with the same prefix restores from them. A speculative
verification step keeps the state after every draft (until the next step), so rejecting drafts
returns exactly to the state after the last accepted one.

The layer computation itself is the model's (its projections, ``conv1d`` weights, norm and the
module's own delta-rule functions); this file only feeds each sequence its own state: decode
rows together (one recurrent step, batched), prefill chunks one by one (the chunked rule).
"""
from __future__ import annotations

import functools
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from pipeline.errors import UserError

LINEAR = "linear_attention"
ZERO_SLOT = 0  # the state of an empty sequence: all zeros, never handed out, never written


class OutOfSlots(Exception):
    """No free or evictable state slot (the engine treats it like running out of blocks)."""


# --- shapes ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateShape:
    """What one sequence's recurrent state holds: per linear layer a convolution window
    [channels, kernel - 1] (model dtype) and a delta-rule matrix [value heads, key dim, value dim]
    (float32, as the model's own cache keeps it)."""

    layers: tuple[int, ...]  # decoder layer indices that are linear attention
    conv: tuple[int, int]
    matrix: tuple[int, int, int]
    dtype: torch.dtype

    @property
    def slot_bytes(self) -> int:
        conv = self.conv[0] * self.conv[1] * torch.empty((), dtype=self.dtype).element_size()
        return len(self.layers) * (conv + self.matrix[0] * self.matrix[1] * self.matrix[2] * 4)


def state_shape(config: Any, dtype: torch.dtype) -> StateShape | None:
    """The recurrent state of a config's linear-attention layers (None: it has none)."""
    from pipeline.memory import layer_kinds, text_config

    layers = tuple(i for i, kind in enumerate(layer_kinds(config)) if kind == LINEAR)
    if not layers:
        return None
    text = text_config(config)
    hk, hv = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
    dk, dv = int(text.linear_key_head_dim), int(text.linear_value_head_dim)
    channels = 2 * hk * dk + hv * dv
    return StateShape(layers, (channels, int(text.linear_conv_kernel_dim) - 1), (hv, dk, dv), dtype)


# --- slots in the pool ------------------------------------------------------------------------
class StateSlots:
    """Fixed state slots for every linear layer, reference-counted, with checkpoints registered
    under prefix-cache hashes (least recently used evicted first when slots run out).

    ``reserved``: slots that optional checkpoints never take, so that running sequences can
    always get the fresh slot each forward writes.
    """

    def __init__(self, shape: StateShape, num_slots: int, devices: Sequence[torch.device], reserved: int = 0) -> None:
        if num_slots < 2:
            raise ValueError(f"a state pool needs at least 2 slots (one is the zero state), got {num_slots}")
        self.shape = shape
        self.num_slots = int(num_slots)
        self.reserved = int(reserved)
        self.devices = list(devices)
        self.lock = threading.RLock()
        self.refs = [0] * self.num_slots
        self._free = list(range(self.num_slots - 1, ZERO_SLOT, -1))
        self._by_digest: dict[int, int] = {}  # prefix-cache hash -> registered slot
        self._digest_of: dict[int, int] = {}  # registered slot -> its hash
        # Registered checkpoints nobody but the registry holds, least recently used first (as
        # BlockPool's evictable blocks): what ``allocate`` takes when no slot is free.
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (conv, matrix) slabs

    @property
    def slot_bytes(self) -> int:
        return self.shape.slot_bytes

    @property
    def free_slots(self) -> int:
        """Slots that can be handed out now (free, or holding a checkpoint only the registry keeps)."""
        with self.lock:
            return len(self._free) + len(self._idle)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s slabs: conv [slots, channels, kernel - 1], matrix [slots, heads, dk, dv]."""
        with self.lock:
            if layer not in self._tensors:
                device = self.devices[layer] if layer < len(self.devices) else torch.device("cpu")
                s = self.num_slots
                conv = torch.empty((s, *self.shape.conv), dtype=self.shape.dtype, device=device)
                matrix = torch.empty((s, *self.shape.matrix), dtype=torch.float32, device=device)
                conv[ZERO_SLOT].zero_()
                matrix[ZERO_SLOT].zero_()
                self._tensors[layer] = (conv, matrix)
            return self._tensors[layer]

    def allocate(self, optional: bool = False) -> int:
        """A slot (reference count 1): a free one, else one whose checkpoint only the registry
        keeps (it leaves the registry). ``optional``: a checkpoint, which leaves ``reserved``
        slots alone. Raises ``OutOfSlots``."""
        with self.lock:
            if optional and self.free_slots <= self.reserved:
                raise OutOfSlots
            if not self._free:
                if not self._idle:
                    raise OutOfSlots
                self.forget(next(iter(self._idle)))
            slot = self._free.pop()
            self.refs[slot] = 1
            return slot

    def hold(self, slot: int) -> int:
        if slot != ZERO_SLOT:
            with self.lock:
                self.refs[slot] += 1
                if self.refs[slot] == 2 and slot in self._digest_of:
                    del self._idle[self._digest_of[slot]]
        return slot

    def release(self, slot: int) -> None:
        if slot == ZERO_SLOT:
            return
        with self.lock:
            self.refs[slot] -= 1
            if self.refs[slot] == 0:
                self._free.append(slot)
            elif self.refs[slot] == 1 and slot in self._digest_of:
                self._idle[self._digest_of[slot]] = None  # most recently used last

    def register(self, digest: int, slot: int) -> None:
        """Keep ``slot`` as the state after the prefix-cache block ``digest`` (for later requests)."""
        with self.lock:
            if digest in self._by_digest or slot in self._digest_of:
                return
            self.hold(slot)
            self._by_digest[digest], self._digest_of[slot] = slot, digest

    def lookup(self, digest: int) -> int | None:
        """The registered state after block ``digest``, held for the caller; None if there is none."""
        with self.lock:
            slot = self._by_digest.get(digest)
            return None if slot is None else self.hold(slot)

    def has(self, digest: int) -> bool:
        return digest in self._by_digest

    def forget(self, digest: int) -> None:
        """The block ``digest`` left the prefix cache: its state is of no use to anyone new."""
        with self.lock:
            slot = self._by_digest.pop(digest, None)
            if slot is not None:
                del self._digest_of[slot]
                self._idle.pop(digest, None)
                self.release(slot)

    def clear_registry(self) -> None:
        with self.lock:
            for digest in list(self._by_digest):
                self.forget(digest)


# --- one forward's view -----------------------------------------------------------------------
@dataclass
class StateIO:
    """Where one chunk's sequence reads its state and where it writes the new ones: ``source``
    (its current slot), ``target`` (the state after the chunk) and ``saves`` (offset within
    the chunk -> slot: checkpoints inside it; ``passing``: those kept only until the next
    forward, after each verified draft)."""

    source: int
    target: int
    saves: dict[int, int] = field(default_factory=dict)
    passing: set[int] = field(default_factory=set)


@dataclass
class StateBatch:
    """The packed forward's state plan: decode rows batched, prefill chunks one by one."""

    slots: StateSlots
    decode_rows: torch.Tensor | None  # packed index of each one-token chunk
    decode_source: torch.Tensor | None
    decode_target: torch.Tensor | None
    chunks: list[tuple[int, int, StateIO]]  # (packed offset, count, io) of the longer chunks


def build_state_batch(slots: StateSlots, chunks: Sequence[Any], device: torch.device) -> StateBatch:
    """The plan for ``chunks`` (``paged.Chunk`` with ``state`` set by ``KVCache.reserve``)."""
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
        return torch.tensor(values, device=device) if values else None

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
        out, matrix = rule(q, k, v, g=g[rows].view(b, count, -1), beta=beta[rows].view(b, count, -1),
                           initial_state=matrix, output_final_state=True, use_qk_l2norm_in_kernel=True)
        core[rows] = out.reshape(b * count, *core.shape[1:])
        return window[..., -conv_slab.shape[-1]:], matrix

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


def _forward(module: torch.nn.Module, original: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
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
                raise UserError(f"linear-attention layers like {type(module).__name__} are not supported by the paged "
                                f"engine (no {', '.join(missing)}): only Gated DeltaNet as in Qwen3.5")
            if not module.__dict__.get("_mm_linear"):
                # Under accelerate's hooks (device_map) wrap the inner forward, so they still run.
                name = "_old_forward" if hasattr(module, "_old_forward") else "forward"
                setattr(module, name, functools.partial(_forward, module, getattr(module, name)))
                module.__dict__["_mm_linear"] = True
            found.append(layer)
    if sorted(found) != sorted(shape.layers):
        raise UserError(f"the config names linear-attention layers {list(shape.layers)} but the model has Gated "
                        f"DeltaNet modules at {sorted(found)}: the paged engine cannot run it")
