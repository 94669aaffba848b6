"""Chunk-KV stores for position-independent KV reuse: memory, disk and Redis tiers.

:func:`build_store` turns the ``kv_connector_extra_config.stores`` list into a
:class:`TieredStore`; :func:`shared_store` returns one instance per process and argument set, so
the scheduler-side and worker-side connector objects of one process share the memory tier.
"""

from __future__ import annotations

import atexit
import threading

from vllm_accel.kv_connector.stores.base import ChunkKV, ChunkStore, StoreStats
from vllm_accel.kv_connector.stores.disk import DiskStore
from vllm_accel.kv_connector.stores.memory import MemoryStore
from vllm_accel.kv_connector.stores.tiered import TieredStore

__all__ = [
    "ChunkKV",
    "ChunkStore",
    "DiskStore",
    "MemoryStore",
    "StoreStats",
    "TieredStore",
    "build_store",
    "shared_store",
]

ACCEPTED_SPECS = "'memory', 'disk:/some/path', 'redis://host:port/db' (or rediss://)"


def build_store(specs: list[str], memory_bytes: int) -> TieredStore:
    """One tier per spec, in the given order (put the fastest first).

    Raises ValueError naming the bad entry and the accepted forms."""
    if isinstance(specs, str) or not specs:
        raise ValueError(
            f"expected a non-empty list of chunk stores, each one of {ACCEPTED_SPECS}; "
            f"got {specs!r}"
        )
    return TieredStore([_build_tier(spec, memory_bytes) for spec in specs])


def _build_tier(spec: str, memory_bytes: int) -> ChunkStore:
    text = spec.strip() if isinstance(spec, str) else ""
    if text == "memory":
        return MemoryStore(memory_bytes)
    if text.startswith("disk:") and text[len("disk:") :].strip():
        return DiskStore(text[len("disk:") :].strip())
    if text.startswith(("redis://", "rediss://")):
        from vllm_accel.kv_connector.stores.redis_store import RedisStore

        return RedisStore(text)
    raise ValueError(f"unknown chunk store {spec!r}; accepted forms: {ACCEPTED_SPECS}")


_SHARED: dict[tuple[tuple[str, ...], int], TieredStore] = {}
_SHARED_LOCK = threading.Lock()


def shared_store(specs: list[str], memory_bytes: int) -> TieredStore:
    """The process-wide store for these arguments, built on first use. Do not close it: other
    connector objects hold it too; its pending writes are flushed (up to 10 s) at exit."""
    cache_key = (tuple(specs), memory_bytes)
    with _SHARED_LOCK:
        store = _SHARED.get(cache_key)
        if store is None:
            store = _SHARED[cache_key] = build_store(specs, memory_bytes)
            atexit.register(store.flush, 10.0)
        return store
