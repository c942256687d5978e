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
module's own delta-rule functions); ``pipeline.runner.linear`` only feeds each sequence its own state: decode
rows together (one recurrent step, batched), prefill chunks one by one (the chunked rule).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from pipeline.memory import layer_kinds, text_config

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
