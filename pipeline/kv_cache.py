"""One KV cache shared by prefill and decode, which remembers what it holds so it can be reused.

It wraps a transformers ``Cache`` and keeps, per cached position, a hashable key: the token id,
or for media placeholders ``(token_id, content_hash, index)``, so that two different images with
the same number of placeholder tokens can never match.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from transformers import DynamicCache


@dataclass(frozen=True)
class Snapshot:
    """A mark to come back to: the length and what the cache held up to it."""

    length: int
    keys: tuple
    state: dict = field(default_factory=dict)


class KVCache:
    """Reuse (longest matching prefix), rollback (crop), snapshot/restore, size in bytes."""

    def __init__(self, config: Any | None = None, cache: Any | None = None) -> None:
        self.config = config
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
    def nbytes(self) -> int:
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
        n = min(len(self.keys), len(keys))
        i = 0
        while i < n and self.keys[i] == keys[i]:
            i += 1
        return i

    def reuse(self, keys: Sequence[Hashable]) -> int:
        """Keep the longest cached prefix of ``keys``, drop the rest; return how many are kept.

        At least one token is always left to compute, because prefill must produce logits.
        """
        n = min(self.common_prefix(keys), len(keys) - 1)
        n = max(n, 0)
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
        self.cache.crop(n - self.cache_length())
        del self.keys[n:]

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
        self.cache = DynamicCache(config=self.config)
        self.keys.clear()
        self.state.clear()
