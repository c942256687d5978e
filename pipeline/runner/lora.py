"""LoRA in the engine's forwards: each target layer adds its rows' low-rank products.

peft computes a LoRA layer as ``base(x) + B(A(x)) * scale``. Here the base layer runs once for
the whole packed step, whatever adapters its rows use (the base weights read once), and a forward
hook on it adds the low-rank part (``register_forward_hook``: the module, its name and its
quantised weights stay as loaded, so nothing else in the engine notices adapters):

- no row of the step has an adapter: the layers run as loaded, unhooked;
- every row has the same adapter: that adapter's own ``B(A(x)) * scale``, peft's arithmetic;
- rows of several adapters (and rows of none): one product over the concatenated factors of
  the loaded adapters, masked per token: ``B_cat((A_cat x) * mask)``, where a token's mask row
  holds its adapter's scale on that adapter's columns and zeros elsewhere. Three operations per
  layer whatever the number of adapters, against one segment product per adapter; the extra
  arithmetic is the loaded adapters' total rank per token, small beside the base layer's.

The plan (which adapter each token has) is set around a forward on the thread running it
(``applied``), and the hooks are there only meanwhile; a compiled or graphed step never runs
with one (the runner runs adapter rows eagerly), and a hook does nothing while compiling.
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

    modules: list[torch.nn.Module]  # the target layers, hooked while the plan is applied
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
            return _added(out, F.linear(x.to(w.a.dtype), w.a), w.b, w.scale)
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
        return _added(out, F.linear(x.to(layer.a.dtype), layer.a).mul_(mask), layer.b, 1.0)


def _added(out: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``out + B(xa) * scale``: one fused product-and-add into ``out`` (the layer's fresh output)
    where the dtypes agree; else peft's way, the sum in the factors' float32, cast back."""
    if out.dtype != xa.dtype or not out.is_contiguous():
        return (out + F.linear(xa, b) * scale).to(out.dtype)
    out.view(-1, out.shape[-1]).addmm_(xa.view(-1, xa.shape[-1]), b.t(), alpha=scale)
    return out


def _hook(module: torch.nn.Module, args: tuple, out: Any) -> Any:
    if torch.compiler.is_compiling():  # (another thread's compiled step: it never has adapter rows)
        return None
    plan = getattr(_state, "plan", None)
    return None if plan is None else plan.add(module.__dict__["_mm_lora"], args[0], out)


class Hooks:
    """The forward hooks on target layers, there only while some thread runs a forward with a
    plan (``applied``): steps without adapter rows, and compiled or graphed steps, call the
    layers as loaded. Counted per layer, so that threads stepping two engines on one model share
    one hook, which reads each thread's own plan."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, tuple[Any, int]] = {}  # id(module) -> (hook handle, users)

    def hold(self, modules: Sequence[torch.nn.Module]) -> None:
        with self._lock:
            for module in modules:
                handle, users = self._held.get(id(module), (None, 0))
                self._held[id(module)] = (handle or module.register_forward_hook(_hook), users + 1)

    def release(self, modules: Sequence[torch.nn.Module]) -> None:
        with self._lock:
            for module in modules:
                handle, users = self._held[id(module)]
                if users == 1:
                    handle.remove()
                    del self._held[id(module)]
                else:
                    self._held[id(module)] = (handle, users - 1)


_HOOKS = Hooks()


class Bank:
    """A model's target layers (by name) and the stacked factors of the adapters its steps use,
    rebuilt when that set changes (an adapter loaded or unloaded, or still in use by a request
    after it was unloaded)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._key: tuple = ()
        self._stacks: Stacks | None = None
        self._modules: dict[str, torch.nn.Module] = {}

    def modules(self, names: Any) -> list[torch.nn.Module]:
        """The layers of these names, each marked with its name (read by the hook)."""
        for name in names:
            if name not in self._modules:
                module = self._modules[name] = self.model.get_submodule(name)
                module.__dict__["_mm_lora"] = name
        return [self._modules[name] for name in names]

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
    bank = lm.__dict__.get("_mm_lora_bank") or lm.__dict__.setdefault("_mm_lora_bank", Bank(lm.model))
    if len(used) == 1 and all(a is not None for a in adapters):
        single = next(iter(used.values()))
        return Plan(bank.modules(single.layers), single=single)
    stacks = bank.stacks(lm.adapters.loaded(), list(used.values()))
    slots = [0 if a is None else stacks.slots[a.uid] for a, n in zip(adapters, counts) for _ in range(n)]
    return Plan(bank.modules(stacks.layers), stacks=stacks, slots=torch.tensor(slots, device=device))


@contextlib.contextmanager
def applied(plan: Plan | None) -> Iterator[None]:
    """Run the model with this plan on the calling thread (its target layers hooked meanwhile)."""
    previous = getattr(_state, "plan", None)
    _state.plan = plan
    if plan is not None:
        _HOOKS.hold(plan.modules)
    try:
        yield
    finally:
        if plan is not None:
            _HOOKS.release(plan.modules)
        _state.plan = previous
