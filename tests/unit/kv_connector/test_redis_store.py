"""RedisStore against a real ``redis-server`` on loopback: roundtrip, dead server, corruption."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from vllm_accel.bench.server import free_port
from vllm_accel.kv_connector.stores import build_store

from .test_stores import FP, assert_same, key, make_chunk

redis = pytest.importorskip("redis", reason="redis-py not installed: pip install redis")

from vllm_accel.bench.redis_server import RedisServer  # noqa: E402
from vllm_accel.bench.redis_server import available as redis_server_available  # noqa: E402
from vllm_accel.kv_connector.stores.redis_store import RedisStore  # noqa: E402

PREFIX = "vllm_accel:chunk:"


def start_redis(port: int | None = None) -> RedisServer:
    if not redis_server_available():
        pytest.skip("redis-server not installed: apt-get install -y redis-server")
    server = RedisServer(port)
    server.start()
    return server


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = start_redis()
    yield server
    server.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip(server, dtype):
    store = RedisStore(server.url, ttl_s=60)
    chunk = make_chunk(dtype=dtype)
    assert store.get(key(1), FP) is None and not store.contains(key(1))
    store.put(key(1), chunk)
    assert store.contains(key(1))
    assert_same(store.get(key(1), FP), chunk)
    assert 0 < server.client().pttl(PREFIX + key(1)) <= 60_000
    assert store.get(key(1), "model-b") is None
    s = store.stats()
    assert (s["hits"], s["misses"], s["puts"], s["mismatched"], s["errors"]) == (1, 1, 1, 1, 0)
    store.close()


def test_without_ttl_keys_do_not_expire(server):
    store = RedisStore(server.url, key_prefix="other:")
    store.put(key(1), make_chunk())
    assert server.client().pttl("other:" + key(1)) == -1  # no expiry
    assert server.client().exists(PREFIX + key(1)) == 0


def test_server_killed_mid_run(server):
    store = RedisStore(server.url, timeout_s=1.0, backoff_s=60)
    store.put(key(1), make_chunk())
    assert store.get(key(1), FP) is not None
    server.kill()
    start = time.perf_counter()
    assert store.get(key(1), FP) is None
    assert time.perf_counter() - start < 3.0
    assert store.stats()["errors"] == 1
    start = time.perf_counter()  # backing off: no network at all
    store.put(key(2), make_chunk())
    assert not store.contains(key(1))
    assert store.get(key(1), FP) is None
    assert time.perf_counter() - start < 0.5
    s = store.stats()
    assert (s["errors"], s["hits"], s["puts"]) == (4, 1, 1)


def test_unresponsive_server_costs_about_the_timeout():
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        store = RedisStore(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", timeout_s=0.5)
        start = time.perf_counter()
        assert store.get(key(1), FP) is None
        assert 0.4 < time.perf_counter() - start < 1.2  # one timeout, no client-side retries
        assert store.stats()["errors"] == 1


def test_server_down_at_start_then_back_after_backoff():
    port = free_port()
    store = RedisStore(f"redis://127.0.0.1:{port}/0", timeout_s=0.5, backoff_s=1.0)
    start = time.perf_counter()
    assert store.get(key(1), FP) is None
    store.put(key(1), make_chunk())
    assert not store.contains(key(1))
    assert time.perf_counter() - start < 3.0
    assert store.stats()["errors"] == 3
    server = start_redis(port)
    try:
        assert store.get(key(1), FP) is None  # still backing off: not even tried
        assert store.stats()["errors"] == 4
        time.sleep(1.1)
        store.put(key(1), make_chunk())
        assert_same(store.get(key(1), FP), make_chunk())
    finally:
        server.close()


def test_corrupt_value_is_counted_and_deleted(server):
    store = RedisStore(server.url)
    server.client().set(PREFIX + key(1), b"garbage bytes, not a chunk")
    assert store.get(key(1), FP) is None
    s = store.stats()
    assert (s["corrupt"], s["errors"], s["hits"]) == (1, 0, 0)
    assert server.client().exists(PREFIX + key(1)) == 0
    store.put(key(2), make_chunk())
    raw = bytearray(server.client().get(PREFIX + key(2)))
    raw[-1] ^= 0xFF
    server.client().set(PREFIX + key(2), bytes(raw))
    assert store.get(key(2), FP) is None and store.stats()["corrupt"] == 2


def test_build_store_with_redis_tier(server, tmp_path):
    tiered = build_store(["memory", f"disk:{tmp_path}", server.url], memory_bytes=1 << 20)
    assert [t.name for t in tiered.tiers] == ["memory", "disk", "redis"]
    tiered.put(key(1), make_chunk())
    assert tiered.flush(timeout=10)
    assert server.client().exists(PREFIX + key(1)) == 1
    tiered.close()


def test_missing_redis_py_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match="pip install redis"):
        RedisStore("redis://127.0.0.1:1/0")
