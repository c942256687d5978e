"""One KV cache shared by prefill and decode, which remembers what it holds so it can be reused.

It wraps a transformers ``Cache`` and keeps, per cached position, a hashable key: the token id,
or for media placeholders ``(token_id, content_hash, index)``, so that two different images with
the same number of placeholder tokens can never match.

Static caches (``KVCache(config, static=True, max_cache_len=N)``) pre-allocate N positions once,
so the decode step has fixed shapes and fixed addresses (what ``torch.compile`` and CUDA graphs
need). transformers' ``StaticCache`` cannot crop; here rollback rewinds each layer's write
position instead: entries past the length stay in memory but are masked out (the causal mask
is built from the write position) and are overwritten by the next tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch
from transformers import DynamicCache, StaticCache

from pipeline.errors import UserError


def shared_prefix_length(*sequences: Sequence[Hashable]) -> int:
    """How many leading items all the sequences share (cache keys: ids, media hashes)."""
    if not sequences:
        return 0
    first, n = sequences[0], min(len(s) for s in sequences)
    for other in sequences[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return n


@dataclass(frozen=True)
class Snapshot:
    """A mark to come back to: the length and what the cache held up to it."""

    length: int
    keys: tuple
    state: dict = field(default_factory=dict)


class KVCache:
    """Reuse (longest matching prefix), rollback (crop), snapshot/restore, size in bytes.

    ``static=True`` pre-allocates ``max_cache_len`` positions (a transformers ``StaticCache``);
    a request that needs more is refused with a ``UserError`` (see ``ensure_capacity``).
    """

    def __init__(
        self,
        config: Any | None = None,
        cache: Any | None = None,
        *,
        static: bool = False,
        max_cache_len: int | None = None,
    ) -> None:
        self.config = config
        if static and cache is None:
            if not max_cache_len or max_cache_len < 1:
                raise ValueError(f"a static KV cache needs max_cache_len >= 1 (got {max_cache_len!r})")
            with torch.inference_mode():  # like every tensor the stages make: no guard mismatch later
                cache = StaticCache(config=config, max_cache_len=int(max_cache_len))
        self.cache = cache if cache is not None else DynamicCache(config=config)
        self.keys: list[Hashable] = []
        # Position state a family needs to continue (e.g. Qwen2-VL rope_deltas); reset with the cache.
        self.state: dict[str, Any] = {}

    @property
    def length(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return self.length

    @property
    def is_static(self) -> bool:
        """Pre-allocated (transformers ``StaticCache``): fixed shapes, rollback by rewinding."""
        return isinstance(self.cache, StaticCache)

    @property
    def capacity(self) -> int | None:
        """Positions a static cache can hold (None: a dynamic cache grows as needed)."""
        if not self.is_static:
            return None
        return min(int(layer.max_cache_len) for layer in self.cache.layers)

    def ensure_capacity(self, needed: int) -> None:
        """Refuse, before any work, a request that would write past a static cache's end.

        Why: an out-of-range write into a pre-allocated cache is an index error on CPU and a
        device-side assert (a dead CUDA context) on GPU.
        """
        capacity = self.capacity
        if capacity is not None and needed > capacity:
            raise UserError(
                f"the static KV cache holds {capacity} tokens but this request needs {needed} "
                f"(prompt + max_new_tokens - 1): raise kv.max_len or lower max_new_tokens"
            )

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values held in memory: for a static cache, the whole pre-allocation."""
        total = 0
        for layer in getattr(self.cache, "layers", []):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if t is not None and hasattr(t, "numel"):
                    total += t.numel() * t.element_size()
        return total

    def append(self, keys: Sequence[Hashable]) -> None:
        """Record what the model just wrote into the cache (prefill or decode did the writing)."""
        self.keys.extend(keys)

    def common_prefix(self, keys: Sequence[Hashable]) -> int:
        return shared_prefix_length(self.keys, keys)

    def reuse(self, keys: Sequence[Hashable]) -> int:
        """Keep the longest cached prefix of ``keys``, drop the rest; return how many are kept.

        At least one token is always left to compute, because prefill must produce logits.
        """
        n = max(0, min(self.common_prefix(keys), len(keys) - 1))
        self.rollback(n)
        return n

    def rollback(self, n: int) -> None:
        """Return to length ``n`` (drop everything after it)."""
        if n < 0 or n > self.length:
            raise ValueError(f"cannot roll back to {n}: the cache holds {self.length} tokens")
        if n == self.length:
            return
        if n == 0:
            self.clear()
            return
        self._truncate(n)
        del self.keys[n:]

    def trim(self) -> None:
        """Drop what the model wrote past the recorded keys (a decode loop that ran ahead of its
        EOS check), so that the cache holds exactly ``keys`` again."""
        if self.keys:
            self._truncate(self.length)  # per layer: a no-op where nothing ran ahead
        else:
            self.clear()

    def _truncate(self, n: int) -> None:
        """Make the underlying cache hold its first ``n`` positions (0 < n <= what it holds)."""
        if not self.is_static:
            # Layer by layer: a forward interrupted by Ctrl-C can leave later layers shorter.
            for layer in self.cache.layers:
                extra = int(layer.get_seq_length()) - n
                if extra > 0:
                    layer.crop(-extra)
            return
        for layer in self.cache.layers:
            if not layer.is_initialized:
                continue
            if getattr(layer, "is_sliding", False):
                if layer.get_seq_length() != n:  # a host int on sliding layers: no sync
                    raise UserError(  # a setting the user can change, not a programming error
                        "cannot roll back a static cache with sliding-window layers "
                        "(its ring buffer has overwritten older positions): use kv.static=false"
                    )
                continue
            with torch.inference_mode():  # the tensors were made under inference mode
                layer.cumulative_length.fill_(n)  # in place: compiled graphs hold its address

    def cache_length(self) -> int:
        return int(self.cache.get_seq_length()) if self.keys else 0

    def snapshot(self) -> Snapshot:
        return Snapshot(self.length, tuple(self.keys), dict(self.state))

    def restore(self, snap: Snapshot) -> None:
        """Roll back to a snapshot taken on this cache; its prefix must still be what it held."""
        if self.length < snap.length or tuple(self.keys[: snap.length]) != snap.keys:
            raise ValueError("snapshot no longer matches the cache (it was cleared or overwritten)")
        self.rollback(snap.length)
        self.state = dict(snap.state)

    def clear(self) -> None:
        if self.is_static:
            with torch.inference_mode():  # the tensors were made under inference mode
                self.cache.reset()  # in place: keeps the allocation and the addresses compiled code uses
        else:
            self.cache = DynamicCache(config=self.config)
        self.keys.clear()
        self.state.clear()
