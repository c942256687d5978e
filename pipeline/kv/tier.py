"""A second tier for evicted prefix-cache blocks: host memory or a folder on disk.

When the pool evicts an unreferenced cached block, its exact bytes go here, keyed by the block's
chain hash (``digest``) and checked against its cache keys on the way back, so a later request
with the same prefix loads the block instead of recomputing it.

``DiskTier`` keeps one file per block: a write is atomic (a temporary name, then ``os.replace``),
a corrupt or torn file costs one block (its crc is checked on every read: it is refused and
recomputed, never loaded wrong), and a restarted server re-indexes the folder by file names
alone, oldest first by mtime. File names carry a hash of the model and settings, so other models'
blocks in the same folder are never read, counted or deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.errors import UserError

__all__ = ["DiskTier", "HostTier", "TIERS", "check_tier", "make_tier"]

TIERS = ("none", "host", "disk")  # kv.offload
MAGIC = b"MMKVBLOCK1\n"
ALIGN = 4096  # the data starts at a multiple of this (mapped aligned); the usual header's room
MASK = 2**64 - 1  # digests are signed (Python's hash): indexes and file names hold them unsigned
COUNTERS = ("hits", "misses", "stores", "evictions", "bytes_loaded", "load_s", "refused")
STALE_TMP_S = 3600  # a temporary file this old is a crashed write's leftover

log = logging.getLogger(__name__)


def _check_blob(blob: torch.Tensor, nbytes: int) -> None:
    if blob.dtype != torch.uint8 or tuple(blob.shape) != (nbytes,) or blob.device.type != "cpu":
        raise ValueError(
            f"a tier stores {nbytes} bytes as a 1-D uint8 CPU tensor, got {blob.dtype} "
            f"{tuple(blob.shape)} on {blob.device}"
        )


def _keys_json(keys: Any) -> str | None:
    """The keys as compact JSON (tuples become lists), or None if JSON cannot hold them."""
    try:
        return json.dumps(keys, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return None


class _Refused(Exception):
    """A block file that must not load (the message says why)."""


class _Tier:
    """What both tiers share: one lock, an LRU index (least recently used first), the counters."""

    kind = ""

    def __init__(self, block_nbytes: int, max_bytes: int) -> None:
        self.block_nbytes, self.max_bytes = int(block_nbytes), int(max_bytes)
        self.lock = threading.Lock()
        self._lru: OrderedDict[int, Any] = OrderedDict()
        self._n = dict.fromkeys(COUNTERS, 0) | {"load_s": 0.0}

    def __contains__(self, digest: int) -> bool:
        """Cheap membership: the index only, no I/O."""
        return digest & MASK in self._lru

    def _hit(self, key: int, start: float) -> None:
        self._lru.move_to_end(key)
        self._n["hits"] += 1
        self._n["bytes_loaded"] += self.block_nbytes
        self._n["load_s"] += time.perf_counter() - start

    def _held_bytes(self) -> int:
        return len(self._lru) * self.block_nbytes

    def flush(self) -> None:
        """Nothing is ever pending: put copies or writes before it returns."""

    def stats(self) -> dict:
        with self.lock:
            return {
                "tier": self.kind,
                "blocks": len(self._lru),
                "bytes": self._held_bytes(),
                "max_bytes": self.max_bytes,
                **self._n,
            }


class HostTier(_Tier):
    """Evicted blocks in host memory, least recently used dropped first (``max_bytes`` bound).

    ``pin``: keep pinned copies, so a block goes back to the GPU asynchronously.
    """

    kind = "host"

    def __init__(self, block_nbytes: int, max_bytes: int, pin: bool = False) -> None:
        if max_bytes < block_nbytes:
            raise UserError(f"kv.offload_bytes ({max_bytes}) is smaller than one KV block ({block_nbytes} bytes)")
        super().__init__(block_nbytes, max_bytes)
        self.pin, self.capacity = pin, self.max_bytes // self.block_nbytes

    def put(self, digest: int, keys: tuple, blob: torch.Tensor) -> None:
        """Keep the caller's copy (or a pinned copy of it); a present block only moves to most recent."""
        _check_blob(blob, self.block_nbytes)
        key = digest & MASK
        with self.lock:
            if key in self._lru:
                return self._lru.move_to_end(key)
            while len(self._lru) >= self.capacity:
                self._lru.popitem(last=False)
                self._n["evictions"] += 1
            if self.pin:
                blob = torch.empty(self.block_nbytes, dtype=torch.uint8, pin_memory=True).copy_(blob)
            self._lru[key] = (keys, blob)
            self._n["stores"] += 1

    def get(self, digest: int, keys: tuple) -> torch.Tensor | None:
        """The block's bytes, or None (absent, or another block's keys under the same hash)."""
        start, key = time.perf_counter(), digest & MASK
        with self.lock:
            entry = self._lru.get(key)
            if entry is None or entry[0] != keys:
                self._n["misses"] += 1
                return None
            self._hit(key, start)
            return entry[1]


class DiskTier(_Tier):
    """Evicted blocks as files in ``folder``, one per block, least recently used deleted first.

    ``fingerprint`` names the model and settings the bytes belong to (the pool builds it): its
    hash prefixes every file name, and the header repeats it whole. ``max_bytes`` bounds the
    files' real sizes (a block and its header: one 4096-byte page, more for very long keys).
    """

    kind = "disk"

    def __init__(self, folder: str | Path, block_nbytes: int, max_bytes: int, fingerprint: str) -> None:
        if max_bytes < block_nbytes + ALIGN:
            raise UserError(
                f"kv.offload_bytes ({max_bytes}) is smaller than one KV block file ({block_nbytes + ALIGN} "
                f"bytes: {block_nbytes} of data and a {ALIGN}-byte header)"
            )
        super().__init__(block_nbytes, max_bytes)
        self.folder, self.fingerprint = Path(folder), fingerprint
        self.fp = hashlib.sha256(fingerprint.encode()).hexdigest()[:12]
        self._bytes = 0  # the indexed files' sizes (_lru: unsigned digest -> file size)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.folder, prefix=f".{self.fp}-", suffix=".tmp")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise UserError(f"kv.offload_dir {str(self.folder)!r} cannot be created or written: {e}") from None
        self._scan()

    def path(self, digest: int) -> Path:
        return self.folder / f"{self.fp}-{digest & MASK:016x}.kvblock"

    def _scan(self) -> None:
        """Index our files by name (no data read), oldest first, and trim to the bound; other
        fingerprints' files are not looked at. Drops our crashed writes' temporaries."""
        ours, found, now = re.compile(rf"{self.fp}-([0-9a-f]{{16}})\.kvblock"), [], time.time()
        with os.scandir(self.folder) as entries:
            for entry in entries:
                with suppress(OSError):  # gone meanwhile (another server trimming the same folder)
                    if (m := ours.fullmatch(entry.name)) and entry.is_file():
                        st = entry.stat()
                        found.append((st.st_mtime_ns, entry.name, int(m.group(1), 16), st.st_size))
                    elif entry.name.startswith(f".{self.fp}-") and now - entry.stat().st_mtime > STALE_TMP_S:
                        os.unlink(entry.path)
        with self.lock:
            for _, _, key, size in sorted(found):
                self._lru[key] = size
                self._bytes += size
            self._make_room(0)

    def _make_room(self, nbytes: int) -> None:
        while self._lru and self._bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._lru)))
            self._n["evictions"] += 1

    def _drop(self, key: int) -> None:
        self._bytes -= self._lru.pop(key)
        with suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def _held_bytes(self) -> int:
        return self._bytes

    def put(self, digest: int, keys: tuple, blob: torch.Tensor) -> None:
        """Write the block's file atomically; a present block only moves to most recent."""
        _check_blob(blob, self.block_nbytes)
        key = digest & MASK
        if _keys_json(keys) is None:
            return  # keys JSON cannot hold: such a block is recomputed when needed
        with self.lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return self._touch(key)
            data = blob.contiguous().numpy()
            header = {
                "fingerprint": self.fingerprint,
                "digest": digest,
                "keys": keys,
                "nbytes": self.block_nbytes,
                "crc32": zlib.crc32(data),
            }
            head = MAGIC + json.dumps(header, separators=(",", ":")).encode() + b"\n"
            head += b" " * (-len(head) % ALIGN)
            size = len(head) + self.block_nbytes
            if size > self.max_bytes:
                return  # a header too long for the bound: recomputed when needed
            self._make_room(size)
            try:
                self._write(self.path(key), head, data)
            except OSError as e:  # disk full, folder gone: recomputed when needed
                return log.warning("KV offload: cannot write a block to %s (%s)", self.folder, e)
            self._lru[key] = size
            self._bytes += size
            self._n["stores"] += 1

    def _write(self, path: Path, head: bytes, data: np.ndarray) -> None:
        """Under a temporary name, then renamed: no reader ever sees half a file under ``path``."""
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{self.fp}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(memoryview(data))
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def _touch(self, key: int) -> None:
        """Most recent on disk too, so the order survives a restart."""
        with suppress(OSError):
            os.utime(self.path(key))

    def get(self, digest: int, keys: tuple) -> torch.Tensor | None:
        """The block's bytes, memory-mapped (copy-on-write: the file never changes), or None:
        absent, another block's keys under the same hash, or a file refused (corrupt, truncated,
        foreign; logged, deleted, counted in ``refused``)."""
        start, key = time.perf_counter(), digest & MASK
        with self.lock:
            data = None
            if key in self._lru:
                path = self.path(key)
                try:
                    data = self._read(path, digest, _keys_json(keys))
                except FileNotFoundError:  # deleted by another tier on this folder
                    self._bytes -= self._lru.pop(key)
                except _Refused as e:
                    log.warning("KV offload: refused %s: %s", path, e)
                    self._drop(key)
                    self._n["refused"] += 1
            if data is None:
                self._n["misses"] += 1
                return None
            self._touch(key)
            self._hit(key, start)
            return data

    def _read(self, path: Path, digest: int, keys_json: str | None) -> torch.Tensor | None:
        """Check a file's header, size and crc, then map its data; None when the keys differ."""
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise _Refused("not a KV block file (bad magic)")
            line, size = f.readline(1 << 20), os.fstat(f.fileno()).st_size
        if not line.endswith(b"\n"):
            raise _Refused("truncated" if size < ALIGN else "corrupt: bad header")
        try:
            header = json.loads(line)
            fingerprint, nbytes, crc = header["fingerprint"], header["nbytes"], header["crc32"]
        except (ValueError, KeyError, TypeError):
            raise _Refused("corrupt: bad header") from None
        if fingerprint != self.fingerprint:
            raise _Refused("written by another model or setting")
        if header.get("digest") != digest or nbytes != self.block_nbytes:
            raise _Refused("corrupt: the header names another block")
        offset = len(MAGIC) + len(line)
        offset += -offset % ALIGN
        if size != offset + nbytes:
            raise _Refused("truncated" if size < offset + nbytes else "corrupt: trailing bytes")
        if keys_json is None or _keys_json(header.get("keys")) != keys_json:
            return None  # a hash collision: the file holds another prefix's block, still good
        data = np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(nbytes,))
        if zlib.crc32(data) != crc:
            raise _Refused("corrupt: crc mismatch")
        return torch.from_numpy(data)


def make_tier(
    kind: str, block_nbytes: int, max_bytes: int, folder: str | None, fingerprint: str, pin: bool
) -> HostTier | DiskTier | None:
    """The tier ``kv.offload`` asks for (None for "none")."""
    check_tier(kind, folder)
    if kind == "none":
        return None
    if kind == "host":
        return HostTier(block_nbytes, max_bytes, pin)
    return DiskTier(folder, block_nbytes, max_bytes, fingerprint)


def check_tier(kind: str, folder: str | None) -> None:
    """``kv.offload`` names a tier, and a disk tier has its folder."""
    if kind not in TIERS:
        raise UserError(f"kv.offload must be one of {', '.join(TIERS)} (got {kind!r})")
    if kind == "disk" and not folder:
        raise UserError("kv.offload=disk needs kv.offload_dir (the folder that keeps the blocks)")
