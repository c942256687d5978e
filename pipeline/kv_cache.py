"""KVCache: one sequence's view of the paged KV pool (a block table), which remembers what it holds.

Per cached position it keeps a hashable key: the token id, or for media placeholders
``(token_id, content_hash, index)``, so that two different images with the same number of
placeholder tokens can never match. Its operations are block operations on the shared pool
(``pipeline.paged.BlockPool``):

- ``reuse(keys)``: keep the longest prefix it already holds, then attach full blocks other
  requests left in the pool's prefix cache; Prefill computes only the rest.
- ``rollback(n)``: drop the blocks past ``n`` (a block shared with another sequence or kept in
  the prefix cache is copied before it is written again: copy on write).
- ``snapshot()`` / ``restore(s)``: marks to branch several continuations from one prefix.
- ``fork()``: a second live sequence sharing this one's blocks.

Blocks are reserved (``reserve``) before a forward writes them and recorded (``append``) once it
has; full blocks then enter the prefix cache. Dropping a KVCache returns its blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence


from pipeline.errors import UserError
from pipeline.paged import BlockPool, OutOfBlocks


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
    """A block table on a ``BlockPool``: reuse, rollback, snapshot/restore, fork, size in bytes."""

    def __init__(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            raise TypeError(f"KVCache needs a BlockPool (Pipeline.new_cache() makes one), got {type(pool).__name__}")
        self.pool = pool
        self.blocks: list[int] = []
        self.keys: list[Hashable] = []
        self._digests: list[int] = []  # chain hash of each full block, in order
        # Position state a family needs to continue (e.g. Qwen2-VL rope_deltas); reset with the cache.
        self.state: dict[str, Any] = {}

    def __del__(self) -> None:
        try:
            self._release_from(0)
        except Exception:  # interpreter shutdown: the pool may be gone already
            pass

    # --- size -------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return self.length

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence holds (shared blocks count in full for each holder)."""
        return len(self.blocks) * self.pool.block_bytes

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold: the whole pool."""
        return self.pool.capacity_tokens

    def ensure_capacity(self, needed: int) -> None:
        """Refuse, before any work, a request that could never fit in the pool."""
        if needed > self.capacity:
            raise UserError(
                f"this request needs {needed} tokens of KV cache (prompt + max_new_tokens - 1) but the whole "
                f"pool holds {self.capacity} ({self.pool.num_blocks - 1} blocks of {self.block_size}): "
                "raise kv.memory or lower max_new_tokens"
            )

    # --- writing ----------------------------------------------------------------------------
    def reserve(self, n: int) -> list[int]:
        """Slots for the next ``n`` positions (blocks allocated, a shared partial block copied).

        Raises ``OutOfBlocks`` with nothing changed when the pool cannot give them.
        """
        bs = self.block_size
        partial = bool(self.length % bs) and bool(self.blocks)
        cow = partial and self.pool.refs[self.blocks[-1]] > 1  # shared (a fork, a prefix hit)
        new: list[int] = []
        try:
            for _ in range(-(-(self.length + n) // bs) - len(self.blocks) + cow):
                new.append(self.pool.allocate())
        except OutOfBlocks:
            for block in new:
                self.pool.release(block)
            raise
        if cow:  # copy on write: the other holders keep the original
            copy = new.pop(0)
            self.pool.copy_block(self.blocks[-1], copy)
            self.pool.release(self.blocks[-1])
            self.blocks[-1] = copy
        elif partial:
            self.pool.unregister(self.blocks[-1])  # ours alone: its cached content is about to change
        self.blocks.extend(new)
        blocks = self.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(self.length, self.length + n)]

    def append(self, keys: Sequence[Hashable]) -> None:
        """Record what the model just wrote into the reserved slots; full blocks enter the prefix cache."""
        self.keys.extend(keys)
        bs = self.block_size
        for i in range(len(self._digests), self.length // bs):
            parent = self._digests[-1] if self._digests else None
            self._digests.append(self.pool.register(self.blocks[i], parent, tuple(self.keys[i * bs : (i + 1) * bs])))

    # --- reuse and rollback -----------------------------------------------------------------
    def common_prefix(self, keys: Sequence[Hashable]) -> int:
        return shared_prefix_length(self.keys, keys)

    def reuse(self, keys: Sequence[Hashable]) -> int:
        """Keep the longest cached prefix of ``keys`` (this sequence's own, then full blocks from
        the pool's prefix cache); return how many tokens are kept.

        At least one token is always left to compute, because prefill must produce logits.
        """
        limit = len(keys) - 1
        self.rollback(max(0, min(self.common_prefix(keys), limit)))
        bs = self.block_size
        while self.length % bs == 0 and self.length + bs <= limit:
            chunk = tuple(keys[self.length : self.length + bs])
            parent = self._digests[-1] if self._digests else None
            block = self.pool.lookup(parent, chunk)
            if block is None:
                break
            self.blocks.append(block)
            self.keys.extend(chunk)
            self._digests.append(self.pool.digest_of(block))
        return self.length

    def future_digests(self, keys: Sequence[Hashable], limit: int | None = None) -> list[int]:
        """Chain hashes of the full blocks of ``keys`` past what this cache holds in full blocks
        (what the prefix cache will know them by once computed); the first ``limit`` of them."""
        bs = self.block_size
        first = self.length // bs
        parent = self._digests[first - 1] if first else None
        out = []
        last = len(keys) // bs if limit is None else min(len(keys) // bs, first + limit)
        for i in range(first, last):
            parent = self.pool.chain(parent, tuple(keys[i * bs : (i + 1) * bs]))
            out.append(parent)
        return out

    def rollback(self, n: int) -> None:
        """Return to length ``n`` (drop everything after it)."""
        if n < 0 or n > self.length:
            raise ValueError(f"cannot roll back to {n}: the cache holds {self.length} tokens")
        if n == 0:
            self.clear()
            return
        del self.keys[n:]
        del self._digests[n // self.block_size :]
        self.trim()

    def trim(self) -> None:
        """Return blocks past the recorded keys (reserved for a forward that did not finish)."""
        self._release_from(-(-self.length // self.block_size))

    def _release_from(self, index: int) -> None:
        for block in self.blocks[index:]:
            self.pool.release(block)
        del self.blocks[index:]

    def snapshot(self) -> Snapshot:
        return Snapshot(self.length, tuple(self.keys), dict(self.state))

    def restore(self, snap: Snapshot) -> None:
        """Roll back to a snapshot taken on this cache; its prefix must still be what it held."""
        if self.length < snap.length or tuple(self.keys[: snap.length]) != snap.keys:
            raise ValueError("snapshot no longer matches the cache (it was cleared or overwritten)")
        self.rollback(snap.length)
        self.state = dict(snap.state)

    def fork(self) -> "KVCache":
        """A second sequence holding the same blocks (no copy; a shared partial block is copied
        by whichever sequence writes into it first)."""
        other = KVCache(self.pool)
        for block in self.blocks:
            self.pool.hold(block)
        other.blocks = list(self.blocks)
        other.keys = list(self.keys)
        other._digests = list(self._digests)
        other.state = dict(self.state)
        return other

    def clear(self) -> None:
        self._release_from(0)
        self.keys.clear()
        self._digests.clear()
        self.state.clear()
