"""Chunk-KV stores: serialization, memory LRU, disk (atomic, checksummed), tiering, build_store."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from vllm_accel.kv_connector import stores
from vllm_accel.kv_connector.stores import (
    ChunkKV,
    ChunkStore,
    DiskStore,
    MemoryStore,
    TieredStore,
    build_store,
    serialization,
    shared_store,
)
from vllm_accel.kv_connector.stores import disk as disk_module
from vllm_accel.kv_connector.stores.base import CorruptChunkError, MismatchedChunkError

FP = "model-a"


def make_chunk(
    seed: int = 0, dtype: torch.dtype = torch.float32, tokens: int = 4, start: int = 7
) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, tokens, 2, 8, generator=g).to(dtype)
    values = torch.randn(2, tokens, 2, 8, generator=g).to(dtype)
    return ChunkKV(keys, values, start_position=start, fingerprint=FP)


def key(i: int | str) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def assert_same(got: ChunkKV | None, want: ChunkKV) -> None:
    assert got is not None
    assert got.keys.dtype == want.keys.dtype and got.values.dtype == want.values.dtype
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert (got.start_position, got.fingerprint) == (want.start_position, want.fingerprint)


def chunk_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file())


# -- serialization ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_serialization_roundtrip_is_bit_exact(dtype):
    chunk = make_chunk(dtype=dtype)
    # A non-contiguous view must serialize to the same data as its contiguous copy.
    strided = ChunkKV(chunk.keys.transpose(1, 2).contiguous().transpose(1, 2), chunk.values, 7, FP)
    assert not strided.keys.is_contiguous()
    assert_same(serialization.deserialize(serialization.serialize(strided)), chunk)


def test_serialization_detects_flipped_bytes_and_truncation():
    blob = serialization.serialize(make_chunk())
    for pos in (0, 40, len(blob) // 2, len(blob) - 1):  # digest, header, tensor data, last byte
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        with pytest.raises(CorruptChunkError):
            serialization.deserialize(bytes(bad))
    for length in (0, 10, len(blob) - 1):
        with pytest.raises(CorruptChunkError):
            serialization.deserialize(blob[:length])


def test_serialization_refuses_other_format_version(monkeypatch):
    monkeypatch.setattr(serialization, "FORMAT_VERSION", "0")
    old = serialization.serialize(make_chunk())
    monkeypatch.undo()
    with pytest.raises(MismatchedChunkError, match="format version"):
        serialization.deserialize(old)


# -- behaviour every store shares -------------------------------------------------------------


@pytest.fixture(params=["memory", "disk"])
def store(request, tmp_path) -> ChunkStore:
    if request.param == "memory":
        return MemoryStore(1 << 20)
    return DiskStore(tmp_path / "chunks")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip(store, dtype):
    chunk = make_chunk(dtype=dtype)
    assert store.get(key(1), FP) is None
    assert not store.contains(key(1))
    store.put(key(1), chunk)
    assert store.contains(key(1))
    assert_same(store.get(key(1), FP), chunk)
    s = store.stats()
    assert (s["hits"], s["misses"], s["puts"], s["errors"]) == (1, 1, 1, 0)
    assert (
        s["bytes_written"]
        == s["bytes_read"]
        == chunk.nbytes()
        == 2 * 2 * 4 * 2 * 8 * (chunk.keys.element_size())
    )


def test_store_keeps_its_own_copy(store):
    chunk = make_chunk()
    expected = make_chunk()
    store.put(key(1), chunk)
    chunk.keys.fill_(0)  # the caller reuses its buffer
    assert_same(store.get(key(1), FP), expected)


def test_fingerprint_mismatch_is_refused_and_counted(store):
    store.put(key(1), make_chunk())
    assert store.get(key(1), "model-b") is None
    s = store.stats()
    assert (s["mismatched"], s["hits"]) == (1, 0)
    assert store.get(key(1), FP) is not None  # still there for the right model


def test_malformed_put_and_bad_keys_never_raise(store):
    bad = ChunkKV(torch.zeros(2, 4, 2, 8), torch.zeros(2, 3, 2, 8), 0, FP)
    store.put(key(1), bad)
    store.put("../../etc/passwd", make_chunk())
    assert store.get("../../etc/passwd", FP) is None
    assert not store.contains("../../etc/passwd")
    assert not store.contains(key(1))
    s = store.stats()
    assert (s["errors"], s["puts"]) == (3, 0)


def test_each_fault_kind_warns_once_then_debug(store, caplog):
    caplog.set_level(logging.DEBUG, logger="vllm.accel")
    store.put(key(1), make_chunk())
    for _ in range(3):
        store.get(key(1), "model-b")
    records = [r for r in caplog.records if "mismatched" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert records[0].name == f"vllm.accel.kv_connector.stores.{store.name}"


# -- memory -----------------------------------------------------------------------------------


def test_memory_lru_evicts_least_recently_used():
    size = make_chunk().nbytes()
    mem = MemoryStore(3 * size)
    for i in range(3):
        mem.put(key(i), make_chunk(i))
    assert mem.get(key(0), FP) is not None  # 0 is now the most recently used; 1 the least
    mem.put(key(3), make_chunk(3))
    assert [mem.contains(key(i)) for i in range(4)] == [True, False, True, True]
    mem.put(key(4), make_chunk(4))
    assert [mem.contains(key(i)) for i in range(5)] == [True, False, False, True, True]
    assert mem.stats()["evictions"] == 2
    assert mem.used_bytes == 3 * size <= mem.capacity_bytes


def test_memory_replacing_a_key_does_not_leak_capacity():
    size = make_chunk().nbytes()
    mem = MemoryStore(2 * size)
    for _ in range(5):
        mem.put(key(0), make_chunk(0))
    mem.put(key(1), make_chunk(1))
    assert mem.used_bytes == 2 * size
    assert mem.contains(key(0)) and mem.contains(key(1))
    assert mem.stats()["evictions"] == 0


def test_memory_skips_chunk_larger_than_capacity():
    mem = MemoryStore(make_chunk().nbytes() - 1)
    mem.put(key(0), make_chunk())
    assert not mem.contains(key(0))
    s = mem.stats()
    assert (s["puts"], s["errors"], mem.used_bytes) == (0, 0, 0)


def test_memory_is_thread_safe():
    size = make_chunk().nbytes()
    mem = MemoryStore(5 * size)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(200):
                mem.put(key(offset + i % 10), make_chunk())
                mem.get(key(offset + (i * 7) % 10), FP)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(100 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert mem.used_bytes == 5 * size
    assert sum(mem.contains(key(100 * t + i)) for t in range(4) for i in range(10)) == 5


# -- disk -------------------------------------------------------------------------------------


def test_disk_persists_across_instances(tmp_path):
    chunk = make_chunk(dtype=torch.bfloat16)
    DiskStore(tmp_path).put(key(1), chunk)
    path = DiskStore(tmp_path).path_for(key(1))
    assert path.is_file() and path.parent.name == key(1)[:2]
    assert_same(DiskStore(tmp_path).get(key(1), FP), chunk)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_disk_corrupt_file_is_counted_and_removed(tmp_path, damage):
    disk = DiskStore(tmp_path)
    disk.put(key(1), make_chunk())
    path = disk.path_for(key(1))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) - 17]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert disk.get(key(1), FP) is None
    s = disk.stats()
    assert (s["corrupt"], s["hits"], s["errors"]) == (1, 0, 0)
    assert not path.exists()
    assert disk.get(key(1), FP) is None and disk.stats()["misses"] == 1


class _FailingFile:
    """Writes half of what it is given, then fails like a full or broken disk."""

    def __init__(self, f, err: int) -> None:
        self._f, self._err = f, err

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def write(self, data: bytes) -> int:
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        raise OSError(self._err, os.strerror(self._err))


def _break_writes(monkeypatch, err: int) -> None:
    real_fdopen = os.fdopen
    monkeypatch.setattr(
        disk_module.os, "fdopen", lambda fd, *a, **k: _FailingFile(real_fdopen(fd, *a, **k), err)
    )


def test_disk_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    disk = DiskStore(tmp_path)
    old = make_chunk(0)
    disk.put(key(1), old)
    before = chunk_files(tmp_path)
    _break_writes(monkeypatch, errno.EIO)
    disk.put(key(1), make_chunk(1))  # overwrite fails half-way
    disk.put(key(2), make_chunk(2))  # new key fails half-way
    monkeypatch.undo()
    assert chunk_files(tmp_path) == before == [f"{key(1)}.chunk"]
    assert_same(disk.get(key(1), FP), old)
    assert not disk.contains(key(2))
    s = disk.stats()
    assert (s["errors"], s["puts"], s["corrupt"]) == (2, 1, 0)


def test_disk_failed_rename_leaves_no_temp_file(tmp_path, monkeypatch):
    disk = DiskStore(tmp_path)

    def no_replace(src, dst):
        raise OSError(errno.EXDEV, "simulated rename failure")

    monkeypatch.setattr(disk_module.os, "replace", no_replace)
    disk.put(key(1), make_chunk())
    monkeypatch.undo()
    assert chunk_files(tmp_path) == []
    assert disk.stats()["errors"] == 1


def test_disk_full_is_counted_not_raised(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="vllm.accel")
    disk = DiskStore(tmp_path)
    _break_writes(monkeypatch, errno.ENOSPC)
    disk.put(key(1), make_chunk())
    disk.put(key(2), make_chunk())
    monkeypatch.undo()
    s = disk.stats()
    assert (s["errors"], s["puts"], s["bytes_written"]) == (2, 0, 0)
    assert chunk_files(tmp_path) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]


def test_disk_unusable_directory_never_raises(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    disk = DiskStore(blocker / "chunks")  # cannot be created: counted, not raised
    assert disk.stats()["errors"] == 1
    disk.put(key(1), make_chunk())
    assert disk.get(key(1), FP) is None
    assert not disk.contains(key(1))
    s = disk.stats()
    assert (s["errors"], s["puts"], s["hits"]) == (3, 0, 0)


def test_disk_capacity_evicts_least_recently_used_files(tmp_path):
    size = len(serialization.serialize(make_chunk()))
    disk = DiskStore(tmp_path, capacity_bytes=2 * size + size // 2)
    disk.put(key(0), make_chunk(0))
    disk.put(key(1), make_chunk(1))
    os.utime(disk.path_for(key(0)), (1000, 1000))
    os.utime(disk.path_for(key(1)), (2000, 2000))
    assert disk.get(key(0), FP) is not None  # a hit makes key 0 the most recently used
    disk.put(key(2), make_chunk(2))
    assert [disk.contains(key(i)) for i in range(3)] == [True, False, True]
    assert disk.stats()["evictions"] == 1
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.chunk")) <= disk.capacity_bytes
    tiny = DiskStore(tmp_path / "tiny", capacity_bytes=size - 1)
    tiny.put(key(0), make_chunk())
    assert not tiny.contains(key(0)) and tiny.stats()["errors"] == 0


# -- tiered -----------------------------------------------------------------------------------


class GatedStore(MemoryStore):
    """A slow tier: each write waits for ``gate``; ``started`` is set when a write begins."""

    def __init__(self) -> None:
        super().__init__(1 << 20, name="slow")
        self.gate = threading.Event()
        self.started = threading.Event()

    def _store(self, key: str, chunk: ChunkKV) -> bool:
        self.started.set()
        assert self.gate.wait(10), "test never opened the gate"
        return super()._store(key, chunk)


def test_tiered_put_writes_memory_now_and_slow_tiers_in_background(tmp_path):
    mem, slow = MemoryStore(1 << 20), GatedStore()
    tiered = TieredStore([mem, slow])
    chunk = make_chunk()
    start = time.perf_counter()
    tiered.put(key(1), chunk)
    assert time.perf_counter() - start < 1.0  # did not wait for the gated tier
    assert mem.contains(key(1)) and not slow.contains(key(1))
    assert tiered.flush(timeout=0.2) is False
    assert tiered.stats()["total"]["pending_writes"] == 1
    slow.gate.set()
    assert tiered.flush(timeout=10) is True
    assert_same(slow.get(key(1), FP), chunk)
    tiered.close()


def test_tiered_async_write_reaches_disk_after_flush(tmp_path):
    disk = DiskStore(tmp_path)
    tiered = TieredStore([MemoryStore(1 << 20), disk])
    tiered.put(key(1), make_chunk())
    assert tiered.flush(timeout=10)
    assert_same(disk.get(key(1), FP), make_chunk())
    tiered.close()


def test_tiered_background_write_does_not_see_later_changes_to_the_callers_tensors():
    slow = GatedStore()
    tiered = TieredStore([MemoryStore(1 << 20), slow])
    chunk = make_chunk()
    tiered.put(key(1), chunk)
    chunk.keys.fill_(0)  # the caller reuses its buffer before the background write runs
    chunk.values.fill_(0)
    slow.gate.set()
    assert tiered.flush(timeout=10)
    assert_same(slow.get(key(1), FP), make_chunk())
    tiered.close()


def test_tiered_sync_writes(tmp_path):
    disk = DiskStore(tmp_path)
    tiered = TieredStore([MemoryStore(1 << 20), disk], async_writes=False)
    tiered.put(key(1), make_chunk())
    assert disk.contains(key(1))
    assert tiered.flush(timeout=0)


def test_tiered_promotes_hits_into_faster_tiers(tmp_path):
    mem, disk = MemoryStore(1 << 20), DiskStore(tmp_path)
    tiered = TieredStore([mem, disk])
    chunk = make_chunk(dtype=torch.bfloat16)
    disk.put(key(1), chunk)  # e.g. written by an earlier process
    assert not mem.contains(key(1))
    assert_same(tiered.get(key(1), FP), chunk)
    assert mem.contains(key(1))
    assert_same(tiered.get(key(1), FP), chunk)  # now served by memory
    assert tiered.get(key(2), FP) is None
    s = tiered.stats()
    assert (s["memory"]["hits"], s["disk"]["hits"]) == (1, 1)
    assert (s["total"]["hits"], s["total"]["misses"], s["total"]["promotions"]) == (2, 1, 1)
    assert tiered.contains(key(1)) and not tiered.contains(key(2))
    tiered.close()


def test_tiered_promotion_into_a_middle_tier_is_background(tmp_path):
    mem, slow, disk = MemoryStore(1 << 20), GatedStore(), DiskStore(tmp_path)
    tiered = TieredStore([mem, slow, disk])
    disk.put(key(1), make_chunk())
    assert tiered.get(key(1), FP) is not None
    assert mem.contains(key(1)) and not slow.contains(key(1))
    slow.gate.set()
    assert tiered.flush(timeout=10)
    assert slow.contains(key(1))
    tiered.close()


def test_tiered_full_queue_drops_and_counts(caplog):
    caplog.set_level(logging.WARNING, logger="vllm.accel")
    mem, slow = MemoryStore(1 << 20), GatedStore()
    tiered = TieredStore([mem, slow], max_pending_writes=1)
    tiered.put(key(1), make_chunk(1))
    assert slow.started.wait(10)  # the writer holds write 1
    tiered.put(key(2), make_chunk(2))  # queued
    start = time.perf_counter()
    tiered.put(key(3), make_chunk(3))  # queue full: dropped, not waited for
    tiered.put(key(4), make_chunk(4))
    assert time.perf_counter() - start < 1.0
    assert tiered.stats()["total"]["dropped_writes"] == 2
    assert all(mem.contains(key(i)) for i in (1, 2, 3, 4))
    slow.gate.set()
    assert tiered.flush(timeout=10)
    assert [slow.contains(key(i)) for i in (1, 2, 3, 4)] == [True, True, False, False]
    assert sum("queue full" in r.getMessage() for r in caplog.records) == 1  # warned once
    tiered.close()


def test_tiered_stats_aggregate_tiers(tmp_path):
    tiered = TieredStore([MemoryStore(1 << 20), MemoryStore(1 << 20), DiskStore(tmp_path)])
    tiered.put(key(1), make_chunk())
    tiered.put("not-hex", make_chunk())
    tiered.flush(10)
    (tmp_path / key(1)[:2] / f"{key(1)}.chunk").write_bytes(b"garbage")
    tiered.tiers[2].get(key(1), FP)
    s = tiered.stats()
    assert set(s) == {"memory", "memory2", "disk", "total"}
    assert s["disk"]["corrupt"] == 1 and s["total"]["corrupt"] == 1
    assert s["total"]["errors"] == 1 and s["total"]["puts"] == 1
    assert s["total"]["bytes_written"] == 3 * make_chunk().nbytes()
    tiered.close()


def test_tiered_needs_a_tier():
    with pytest.raises(ValueError, match="at least one tier"):
        TieredStore([])


# -- build_store / shared_store ---------------------------------------------------------------


def test_build_store_builds_tiers_in_order(tmp_path):
    tiered = build_store(["memory", f"disk:{tmp_path}/c"], memory_bytes=123)
    assert [type(t) for t in tiered.tiers] == [MemoryStore, DiskStore]
    assert tiered.tiers[0].capacity_bytes == 123
    assert tiered.tiers[1].root == tmp_path / "c"
    tiered.close()


@pytest.mark.parametrize("bad", ["ram", "disk:", "s3://bucket", "Memory", "http://h:1/0"])
def test_build_store_names_the_bad_spec_and_the_accepted_forms(bad):
    with pytest.raises(ValueError) as info:
        build_store(["memory", bad], memory_bytes=1)
    message = str(info.value)
    assert repr(bad) in message
    for form in ("'memory'", "'disk:/some/path'", "'redis://host:port/db'"):
        assert form in message


@pytest.mark.parametrize("bad", [[], "memory"])
def test_build_store_wants_a_non_empty_list(bad):
    with pytest.raises(ValueError, match="non-empty list"):
        build_store(bad, memory_bytes=1)


def test_shared_store_is_one_instance_per_arguments(monkeypatch, tmp_path):
    monkeypatch.setattr(stores, "_SHARED", {})
    a = shared_store(["memory"], 1 << 20)
    assert shared_store(["memory"], 1 << 20) is a
    assert shared_store(("memory",), 1 << 20) is a
    assert shared_store(["memory"], 1 << 21) is not a
    assert shared_store(["memory", f"disk:{tmp_path}"], 1 << 20) is not a
    a.put(key(1), make_chunk())
    assert shared_store(["memory"], 1 << 20).get(key(1), FP) is not None
