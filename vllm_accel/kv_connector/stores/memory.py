"""In-process chunk store: least-recently-used, bounded by the chunks' KV bytes, thread-safe."""

from __future__ import annotations

import threading
from collections import OrderedDict

from vllm_accel.kv_connector.stores.base import ChunkKV, ChunkStore


class MemoryStore(ChunkStore):
    """Keeps private contiguous CPU copies of at most ``capacity_bytes`` of KV (by
    :meth:`ChunkKV.nbytes`); a chunk larger than the whole capacity is not stored."""

    def __init__(self, capacity_bytes: int, name: str = "memory") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        super().__init__(name)
        self.capacity_bytes = capacity_bytes
        self._chunks: OrderedDict[str, ChunkKV] = OrderedDict()  # oldest use first
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def _load(self, key: str) -> ChunkKV | None:
        with self._lock:
            chunk = self._chunks.get(key)
            if chunk is not None:
                self._chunks.move_to_end(key)
            return chunk

    def _store(self, key: str, chunk: ChunkKV) -> bool:
        size = chunk.nbytes()
        if size > self.capacity_bytes:
            return False
        owned = chunk.to_owned()  # copy outside the lock
        evicted = 0
        with self._lock:
            old = self._chunks.pop(key, None)
            if old is not None:
                self._used -= old.nbytes()
            while self._used + size > self.capacity_bytes:
                _, victim = self._chunks.popitem(last=False)
                self._used -= victim.nbytes()
                evicted += 1
            self._chunks[key] = owned
            self._used += size
        if evicted:
            self._stats.add(evictions=evicted)
        return True

    def _exists(self, key: str) -> bool:
        with self._lock:
            return key in self._chunks

    def close(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._used = 0
