"""LoRA in the engine's forwards: each target layer adds its rows' low-rank products.

peft computes a LoRA layer as ``base(x) + B(A(x)) * scale``. Here the base layer runs once for
the whole packed step, whatever adapters its rows use (the base weights read once), and a forward
hook on it adds the low-rank part (``register_forward_hook``: the module, its name and its
quantised weights stay as loaded, so nothing else in the engine notices adapters):

- no row of the step has an adapter: nothing is added (one attribute read per layer);
- every row has the same adapter: that adapter's own ``B(A(x)) * scale``, peft's arithmetic;
- rows of several adapters (and rows of none): one product over the concatenated factors of
  the loaded adapters, masked per token: ``B_cat((A_cat x) * mask)``, where a token's mask row
  holds its adapter's scale on that adapter's columns and zeros elsewhere. Three operations per
  layer whatever the number of adapters, against one segment product per adapter; the extra
  arithmetic is the loaded adapters' total rank per token, small beside the base layer's.

The plan (which adapter each token has) is set around a forward on the thread running it
(``applied``); a compiled or graphed step never runs with one (the runner runs adapter rows
eagerly), and the hooks do nothing while compiling.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from pipeline.model.lora import Adapter

_state = threading.local()  # .plan: the Plan of the forward running on this thread (None: no adapter rows)


@dataclass
class Stacked:
    """One layer's factors for several adapters side by side: ``a`` [R, in], ``b`` [out, R] and
    ``table`` [slots + 1, R]: row s holds adapter slot s's scale on its columns (row 0, no
    adapter: zeros). Layers with the same column layout share one table object."""

    a: torch.Tensor
    b: torch.Tensor
    table: torch.Tensor


@dataclass
class Stacks:
    """Every adapter's slot (1, 2, ...) and the stacked factors of each target layer."""

    slots: dict[int, int]  # Adapter.uid -> slot
    layers: dict[str, Stacked]


def stack(adapters: Sequence[Adapter]) -> Stacks:
    """The factors of ``adapters`` side by side, per target layer."""
    slots = {a.uid: i + 1 for i, a in enumerate(adapters)}
    names = sorted({name for a in adapters for name in a.layers})
    tables: dict[tuple, torch.Tensor] = {}
    layers = {}
    for name in names:
        present = [(slots[a.uid], a.layers[name]) for a in adapters if name in a.layers]
        a_cat = torch.cat([w.a for _, w in present])
        b_cat = torch.cat([w.b for _, w in present], dim=1)
        layout = tuple((slot, w.a.shape[0], w.scale) for slot, w in present)
        if layout not in tables:
            table = torch.zeros(len(adapters) + 1, a_cat.shape[0], device=a_cat.device)
            col = 0
            for slot, r, scale in layout:
                table[slot, col : col + r] = scale
                col += r
            tables[layout] = table
        layers[name] = Stacked(a_cat, b_cat, tables[layout])
    return Stacks(slots, layers)


@dataclass
class Plan:
    """Which adapter each token of one forward has: ``single`` for all of them, else ``slots``
    [T] (0: none) into ``stacks``. Token masks are made once per column layout per forward."""

    single: Adapter | None = None
    stacks: Stacks | None = None
    slots: torch.Tensor | None = None
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """``out`` with this layer's low-rank part added (None: the layer has none here)."""
        if self.single is not None:
            w = self.single.layers.get(name)
            if w is None:
                return None
            delta = F.linear(F.linear(x.to(w.a.dtype), w.a), w.b) * w.scale
            return (out + delta).to(out.dtype)
        layer = self.stacks.layers.get(name) if self.stacks is not None else None
        if layer is None:
            return None
        mask = self.masks.get(id(layer.table))
        if mask is None:
            slots = self.slots.to(layer.table.device)  # (layers placed on several devices)
            mask = self.masks[id(layer.table)] = layer.table.index_select(0, slots)
        if x.shape[-2] != mask.shape[0]:
            raise RuntimeError(
                f"LoRA layer {name} saw {x.shape[-2]} rows for a step of {mask.shape[0]} tokens: "
                "adapters of different requests cannot share a step through this layer"
            )
        delta = F.linear(F.linear(x.to(layer.a.dtype), layer.a) * mask, layer.b)
        return (out + delta).to(out.dtype)


def _hook(module: torch.nn.Module, args: tuple, out: Any) -> Any:
    if torch.compiler.is_compiling():  # a compiled step never runs adapter rows
        return None
    plan = getattr(_state, "plan", None)
    return None if plan is None else plan.add(module.__dict__["_mm_lora"], args[0], out)


def attach(model: torch.nn.Module, adapter: Adapter) -> None:
    """Hook every layer the adapter targets (once per layer)."""
    for name in adapter.layers:
        module = model.get_submodule(name)
        if "_mm_lora" not in module.__dict__:
            module.__dict__["_mm_lora"] = name
            module.register_forward_hook(_hook)


class Bank:
    """A model's hooked layers and the stacked factors of the adapters its steps use, rebuilt
    when that set changes (an adapter loaded or unloaded, or still in use by a request after it
    was unloaded)."""

    def __init__(self) -> None:
        self._key: tuple = ()
        self._stacks: Stacks | None = None
        self._attached: set[int] = set()  # Adapter.uid whose layers are hooked

    def attach(self, model: torch.nn.Module, adapters: Sequence[Adapter]) -> None:
        for adapter in adapters:
            if adapter.uid not in self._attached:
                attach(model, adapter)
                self._attached.add(adapter.uid)

    def stacks(self, loaded: Sequence[Adapter], used: Sequence[Adapter]) -> Stacks:
        members = {a.uid: a for a in (*loaded, *used)}
        key = tuple(sorted(members))
        if self._stacks is None or key != self._key:
            self._key, self._stacks = key, stack([members[uid] for uid in key])
        return self._stacks


def plan_for(lm: Any, adapters: Sequence[Adapter | None], counts: Sequence[int], device: torch.device) -> Plan | None:
    """The plan of a forward whose rows (``counts`` tokens each, in order) have these adapters;
    None when no row has one."""
    used = {a.uid: a for a in adapters if a is not None}
    if not used:
        return None
    bank = lm.__dict__.setdefault("_mm_lora_bank", Bank())
    bank.attach(lm.model, list(used.values()))
    if len(used) == 1 and all(a is not None for a in adapters):
        return Plan(single=next(iter(used.values())))
    stacks = bank.stacks(lm.adapters.loaded(), list(used.values()))
    slots = [0 if a is None else stacks.slots[a.uid] for a, n in zip(adapters, counts) for _ in range(n)]
    return Plan(stacks=stacks, slots=torch.tensor(slots, device=device))


@contextlib.contextmanager
def applied(plan: Plan | None) -> Iterator[None]:
    """Run the model with this plan on the calling thread."""
    previous = getattr(_state, "plan", None)
    _state.plan = plan
    try:
        yield
    finally:
        _state.plan = previous
