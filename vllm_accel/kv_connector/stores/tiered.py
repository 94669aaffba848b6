"""Tiers of chunk stores, fastest first (memory, then disk, then Redis).

``get`` asks each tier in turn and copies a hit into the faster tiers above it. ``put`` writes
the first tier synchronously and, with ``async_writes``, the slower tiers from one background
thread fed by a bounded queue: when the queue is full the write is dropped and counted
(``dropped_writes``), the caller never waits. Like every store, nothing here raises.
"""

from __future__ import annotations

import queue
import threading
import time

from vllm_accel.kv_connector.stores.base import (
    ChunkKV,
    ChunkStore,
    FaultLog,
    StoreStats,
    guarded_put,
)

# Counters the tiers keep that are summed into the totals; the TieredStore keeps the others
# (hits and misses of the whole hierarchy, caller-side timings, puts, drops, promotions).
_SUMMED = ("errors", "corrupt", "mismatched", "bytes_written", "evictions")

_Write = tuple[str, ChunkKV, tuple[ChunkStore, ...]]


class TieredStore:
    name = "tiered"

    def __init__(
        self, tiers: list[ChunkStore], async_writes: bool = True, max_pending_writes: int = 32
    ) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.async_writes = async_writes
        self._names = _unique_names(self.tiers)
        self._stats = StoreStats(extra=("dropped_writes", "promotions"))
        self._fault = FaultLog(self.name, self._stats)
        self._queue: queue.Queue[_Write | None] = queue.Queue(maxsize=max_pending_writes)
        self._pending = 0
        self._idle = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if async_writes and len(self.tiers) > 1:
            self._thread = threading.Thread(
                target=self._drain, name="vllm-accel-chunk-writer", daemon=True
            )
            self._thread.start()

    def get(self, key: str, fingerprint: str) -> ChunkKV | None:
        start = time.perf_counter()
        try:
            for depth, tier in enumerate(self.tiers):
                chunk = tier.get(key, fingerprint)
                if chunk is not None:
                    self._stats.add(hits=1, bytes_read=chunk.nbytes())
                    if depth:
                        self._stats.add(promotions=1)
                        self._write(key, chunk, self.tiers[:depth])
                    return chunk
            self._stats.add(misses=1)
            return None
        finally:
            self._stats.add(get_seconds=time.perf_counter() - start)

    def put(self, key: str, chunk: ChunkKV) -> None:
        def write() -> None:
            # One private copy, shared by all tiers: the caller may reuse its buffers at once.
            self._write(key, chunk.to_owned(), self.tiers)
            self._stats.add(puts=1)

        guarded_put(key, chunk, self._stats, self._fault, write)

    def contains(self, key: str) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the background writes are done; False if ``timeout`` s passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stats(self) -> dict[str, dict[str, float]]:
        """``{tier name: tier counters, ..., "total": counters of the whole hierarchy}``."""
        per_tier = {name: tier.stats() for name, tier in zip(self._names, self.tiers)}
        total = self._stats.snapshot()
        for counter in _SUMMED:
            total[counter] += sum(s[counter] for s in per_tier.values())
        with self._idle:
            total["pending_writes"] = float(self._pending)
        return {**per_tier, "total": total}

    def close(self, timeout: float = 10.0) -> None:
        """Finish pending writes (waiting at most ``timeout`` s), stop the writer, close tiers."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self.flush(timeout)
            try:
                self._queue.put(None, timeout=1.0)
                self._thread.join(timeout=1.0)
            except queue.Full:
                pass  # the daemon writer dies with the process
        for tier in self.tiers:
            tier.close()

    def _write(self, key: str, chunk: ChunkKV, targets: list[ChunkStore]) -> None:
        now = [t for t in targets if t is self.tiers[0] or self._thread is None]
        later = tuple(t for t in targets if t not in now)
        for tier in now:
            tier.put(key, chunk)
        if not later:
            return
        with self._idle:
            self._pending += 1
        try:
            self._queue.put_nowait((key, chunk, later))
        except queue.Full:
            self._done()
            self._fault("dropped_writes", f"write queue full; dropped the write of {key[:16]}")

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            key, chunk, targets = item
            try:
                for tier in targets:
                    tier.put(key, chunk)
            except Exception as exc:  # a tier broke its contract; keep the writer alive
                self._fault("errors", f"background write of {key[:16]} failed", exc)
            finally:
                self._done()

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()


def _unique_names(tiers: list[ChunkStore]) -> list[str]:
    names: list[str] = []
    for tier in tiers:
        name, n = tier.name, 2
        while name in names or name == "total":
            name, n = f"{tier.name}{n}", n + 1
        names.append(name)
    return names
