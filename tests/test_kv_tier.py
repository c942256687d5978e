"""The second KV tier: evicted blocks come back byte for byte under the same keys, the bounds hold,
and a corrupt, truncated or foreign block file is refused (None, the block is recomputed)."""

from __future__ import annotations

import hashlib
import logging
import os

import pytest
import torch

from pipeline.errors import UserError
from pipeline.kv.tier import ALIGN, DiskTier, HostTier, make_tier

N = 8192  # bytes per block
FP = "model=tiny;dtype=bfloat16;block=16"
FILE = N + ALIGN  # one block's file: a one-page header, then the data
MEDIA = (1, 2, (151655, "ab12cd", 3), (151655, "ab12cd", 4))


def blob() -> torch.Tensor:
    return torch.randint(0, 256, (N,), dtype=torch.uint8)


def keys(i: int) -> tuple:
    return (i, i + 1, i + 2)


def files(folder, fp: str = FP) -> list[str]:
    prefix = hashlib.sha256(fp.encode()).hexdigest()[:12]
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(prefix) and p.suffix == ".kvblock")


# host -------------------------------------------------------------------------------------------
def test_host_round_trip_exact_bytes():
    tier = HostTier(N, 4 * N)
    b = blob()
    tier.put(7, keys(7), b.clone())
    assert 7 in tier and 8 not in tier
    assert torch.equal(tier.get(7, keys(7)), b)
    assert tier.get(8, keys(8)) is None
    s = tier.stats()
    assert (s["tier"], s["blocks"], s["bytes"], s["max_bytes"]) == ("host", 1, N, 4 * N)
    assert (s["hits"], s["misses"], s["stores"], s["bytes_loaded"]) == (1, 1, 1, N)


def test_host_lru_eviction_under_the_bound():
    tier = HostTier(N, 3 * N + N // 2)  # room for 3 blocks
    blobs = {i: blob() for i in range(4)}
    for i in range(3):
        tier.put(i, keys(i), blobs[i])
    assert tier.get(0, keys(0)) is not None  # 0 is now the most recent: 1 goes first
    tier.put(3, keys(3), blobs[3])
    assert 1 not in tier and all(i in tier for i in (0, 2, 3))
    tier.put(2, keys(2), blob())  # already present: refreshed, not rewritten
    assert torch.equal(tier.get(2, keys(2)), blobs[2])
    tier.put(4, keys(4), blob())
    assert 0 not in tier and 2 in tier
    s = tier.stats()
    assert s["blocks"] == 3 and s["bytes"] <= s["max_bytes"] and s["evictions"] == 2


def test_host_keys_mismatch_is_a_miss():
    tier = HostTier(N, 2 * N)
    tier.put(5, keys(5), blob())
    assert tier.get(5, keys(6)) is None
    assert tier.stats()["misses"] == 1 and tier.stats()["hits"] == 0


def test_host_too_small_bound():
    with pytest.raises(UserError, match=rf"kv.offload_bytes.*{N} bytes"):
        HostTier(N, N - 1)


# disk -------------------------------------------------------------------------------------------
def test_disk_round_trip_and_restart(tmp_path):
    tier = DiskTier(tmp_path / "kv", N, 10 * FILE, FP)
    b = blob()
    tier.put(-12345, keys(1), b.clone())  # a negative digest (Python hashes are signed)
    assert -12345 in tier and len(files(tmp_path / "kv")) == 1
    out = tier.get(-12345, keys(1))
    assert out.dtype == torch.uint8 and out.shape == (N,) and torch.equal(out, b)
    assert (tmp_path / "kv" / files(tmp_path / "kv")[0]).stat().st_size == FILE
    again = DiskTier(tmp_path / "kv", N, 10 * FILE, FP)  # a restarted server
    assert -12345 in again and again.stats()["blocks"] == 1 and again.stats()["bytes"] == FILE
    assert torch.equal(again.get(-12345, keys(1)), b)
    assert again.get(-12345, keys(2)) is None  # a collision: a miss, the file stays
    assert -12345 in again and again.stats()["refused"] == 0


def test_disk_lru_eviction_deletes_oldest(tmp_path):
    tier = DiskTier(tmp_path, N, 3 * FILE, FP)
    blobs = {i: blob() for i in range(5)}
    for i in range(3):
        tier.put(i, keys(i), blobs[i])
    names = {i: tier.path(i).name for i in range(5)}
    assert tier.get(0, keys(0)) is not None  # 0 becomes the most recent
    tier.put(3, keys(3), blobs[3])
    assert names[1] not in files(tmp_path) and 1 not in tier
    assert set(files(tmp_path)) == {names[0], names[2], names[3]}
    s = tier.stats()
    assert s["blocks"] == 3 and s["bytes"] == 3 * FILE <= s["max_bytes"] and s["evictions"] == 1
    # the order survives a restart (mtimes): 2 is the oldest now
    os.utime(tier.path(2), ns=(1, 1_000_000_000))
    again = DiskTier(tmp_path, N, 3 * FILE, FP)
    again.put(4, keys(4), blobs[4])
    assert set(files(tmp_path)) == {names[0], names[3], names[4]}
    # a smaller bound trims at start, oldest first
    small = DiskTier(tmp_path, N, 2 * FILE, FP)
    assert small.stats()["blocks"] == 2 and len(files(tmp_path)) == 2 and 4 in small


def test_disk_flipped_byte_is_refused(tmp_path, caplog):
    tier = DiskTier(tmp_path, N, 4 * FILE, FP)
    tier.put(9, keys(9), blob())
    path = tier.path(9)
    raw = bytearray(path.read_bytes())
    raw[ALIGN + 100] ^= 0x01
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        assert tier.get(9, keys(9)) is None
    assert "crc mismatch" in caplog.text and path.name in caplog.text
    assert not path.exists() and 9 not in tier
    s = tier.stats()
    assert s["refused"] == 1 and s["hits"] == 0 and s["blocks"] == 0 and s["bytes"] == 0


def test_disk_foreign_header_is_refused(tmp_path, caplog):
    other = DiskTier(tmp_path, N, 4 * FILE, "another model")
    other.put(3, keys(3), blob())
    tier = DiskTier(tmp_path, N, 4 * FILE, FP)
    os.replace(other.path(3), tier.path(3))  # renamed into our namespace
    again = DiskTier(tmp_path, N, 4 * FILE, FP)
    assert 3 in again
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        assert again.get(3, keys(3)) is None
    assert "another model or setting" in caplog.text
    assert again.stats()["refused"] == 1 and not tier.path(3).exists()


def test_disk_other_fingerprints_left_alone(tmp_path):
    other = DiskTier(tmp_path, N, 4 * FILE, "another model")
    for i in range(3):
        other.put(i, keys(i), blob())
    theirs = files(tmp_path, "another model")
    tier = DiskTier(tmp_path, N, 2 * FILE, FP)  # a smaller bound than their files: nothing trimmed
    assert tier.stats()["blocks"] == 0 and tier.stats()["bytes"] == 0 and 0 not in tier
    for i in range(3):
        tier.put(i, keys(i), blob())
    assert files(tmp_path, "another model") == theirs and len(files(tmp_path)) == 2
    assert tier.stats()["evictions"] == 1


def test_disk_truncated_file(tmp_path, caplog):
    tier = DiskTier(tmp_path, N, 4 * FILE, FP)
    tier.put(1, keys(1), blob())
    tier.put(2, keys(2), blob())
    with open(tier.path(1), "r+b") as f:
        f.truncate(ALIGN + N // 2)
    with open(tier.path(2), "r+b") as f:
        f.truncate(20)  # inside the header
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        assert tier.get(1, keys(1)) is None
        assert tier.get(2, keys(2)) is None
    assert [r.getMessage().endswith(": truncated") for r in caplog.records] == [True, True]
    assert tier.stats()["refused"] == 2 and files(tmp_path) == []


def test_disk_media_keys_round_trip(tmp_path):
    tier = DiskTier(tmp_path, N, 4 * FILE, FP)
    b = blob()
    tier.put(42, MEDIA, b)
    again = DiskTier(tmp_path, N, 4 * FILE, FP)
    assert torch.equal(again.get(42, MEDIA), b)
    assert again.get(42, MEDIA[:-1] + ((151655, "ab12cd", 5),)) is None
    assert again.get(42, (1, 2, 151655, "ab12cd", 3, 151655, "ab12cd", 4)) is None


def test_disk_stats_fields(tmp_path):
    tier = DiskTier(tmp_path, N, 4 * FILE, FP)
    first = blob()
    tier.put(1, keys(1), first)
    tier.put(1, keys(1), blob())  # present: not rewritten
    assert torch.equal(tier.get(1, keys(1)), first)
    assert tier.get(2, keys(2)) is None
    tier.flush()
    s = tier.stats()
    assert set(s) == {
        "tier",
        "blocks",
        "bytes",
        "max_bytes",
        "hits",
        "misses",
        "stores",
        "evictions",
        "bytes_loaded",
        "load_s",
        "refused",
    }
    assert (s["tier"], s["blocks"], s["bytes"], s["max_bytes"]) == ("disk", 1, FILE, 4 * FILE)
    assert (s["hits"], s["misses"], s["stores"], s["evictions"], s["bytes_loaded"], s["refused"]) == (1, 1, 1, 0, N, 0)
    assert s["load_s"] > 0


def test_disk_unwritable_folder(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UserError, match="kv.offload_dir"):
        DiskTier(tmp_path / "file" / "kv", N, 4 * FILE, FP)
    with pytest.raises(UserError, match="kv.offload_bytes"):
        DiskTier(tmp_path, N, N, FP)


def test_make_tier(tmp_path):
    assert make_tier("none", N, 4 * FILE, None, FP, False) is None
    assert isinstance(make_tier("host", N, 4 * N, None, FP, False), HostTier)
    disk = make_tier("disk", N, 4 * FILE, str(tmp_path), FP, False)
    assert isinstance(disk, DiskTier) and disk.folder == tmp_path
    with pytest.raises(UserError, match="kv.offload=disk needs kv.offload_dir"):
        make_tier("disk", N, 4 * FILE, None, FP, False)
    with pytest.raises(UserError, match="none, host, disk"):
        make_tier("ssd", N, 4 * FILE, None, FP, False)


def test_disk_header_longer_than_a_page(tmp_path):
    """A fingerprint holding a whole model config can outgrow one page: the data moves to the next
    page boundary, and the bound counts the file's real size."""
    fp = "config=" + "x" * 6000
    tier = DiskTier(tmp_path, N, 3 * FILE, fp)
    b = blob()
    tier.put(5, keys(5), b)
    assert tier.path(5).stat().st_size == N + 2 * ALIGN and tier.stats()["bytes"] == N + 2 * ALIGN
    again = DiskTier(tmp_path, N, 3 * FILE, fp)
    assert torch.equal(again.get(5, keys(5)), b) and again.stats()["bytes"] == N + 2 * ALIGN
