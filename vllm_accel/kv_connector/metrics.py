"""Counters of the chunk-reuse connector: in the log, and in vLLM's Prometheus metrics.

Each role keeps :class:`ReuseCounters` (the scheduler: requests with chunks, claimed / hit / miss
tokens, markup errors; the worker: loaded and saved bytes, recompute work in token-layers, load
failures) and logs them with the stores' counters every ``log_interval_s`` (a connector knob) and
at shutdown.
The worker also hands vLLM the per-step increments (:class:`ChunkReuseStats`), which vLLM ships
to the API process and records in the ``vllm:chunk_reuse_*`` counters
(:class:`ChunkReusePromMetrics`), next to vLLM's own ``/metrics``.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_accel import faults
from vllm_accel.log import get_logger

logger = get_logger("kv_connector")

#: Prometheus counter -> (increment key, help text). Keys are worker counters, or ``store_*``
#: increments of the stores' totals.
PROM_COUNTERS = {
    "reused_requests": ("reused_requests", "Requests that loaded chunk KV"),
    "markup_errors": ("markup_errors", "Requests with malformed chunk markup (served unreused)"),
    "hit_tokens": ("loaded_tokens", "Claimed prompt tokens whose KV came from a chunk store"),
    "miss_tokens": ("forced_tokens", "Claimed prompt tokens without stored KV (recomputed)"),
    "recompute_token_layers": ("recompute_token_layers",
                               "Token-layers the connector recomputed (selective recompute)"),
    "claimed_token_layers": ("claimed_token_layers",
                             "Token-layers of claimed tokens (what full recompute would cost)"),
    "ape_token_layers": ("ape_token_layers",
                         "Query token-layers attended with APE's temperature and scale"),
    "loaded_bytes": ("loaded_bytes", "Bytes of chunk KV written into the paged cache"),
    "saved_chunks": ("saved_chunks", "Chunks saved to the store"),
    "load_failures": ("load_failures", "Chunks that could not be loaded (recomputed instead)"),
    "store_errors": ("store_errors", "Store faults (IO, connection, timeouts)"),
    "store_corrupt": ("store_corrupt", "Stored chunks refused as corrupt or mismatched"),
    "store_get_seconds": ("store_get_seconds", "Seconds spent reading chunk stores"),
}


class ReuseCounters:
    def __init__(self, side: str, log_interval_s: float = 10.0):
        self.side = side
        self.log_interval_s = log_interval_s
        self._values: dict[str, float] = defaultdict(float)
        self._taken: dict[str, float] = {}
        self._store_taken: dict[str, float] = {}
        self._lock = threading.Lock()
        self._last_log = time.monotonic()

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            values = dict(self._values)
        claimed = values.get("claimed_token_layers", 0)
        if claimed:
            values["recompute_fraction"] = values.get("recompute_token_layers", 0) / claimed
        return values

    def take_increments(self, store: Any) -> dict[str, float]:
        """Counter increases since the last call, plus the stores' (``store_*``)."""
        values = self.snapshot()
        totals = (store.stats().get("total", {}) if store is not None else {})
        store_values = {"store_errors": totals.get("errors", 0.0),
                        "store_corrupt": totals.get("corrupt", 0.0)
                        + totals.get("mismatched", 0.0),
                        "store_get_seconds": totals.get("get_seconds", 0.0)}
        out = {k: v - self._taken.get(k, 0.0) for k, v in values.items()
               if k != "recompute_fraction"}
        out |= {k: v - self._store_taken.get(k, 0.0) for k, v in store_values.items()}
        self._taken, self._store_taken = values, store_values
        return {k: v for k, v in out.items() if v}

    def maybe_log(self, store: Any = None, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_log < self.log_interval_s:
            return
        self._last_log = now
        values = self.snapshot()
        if not values:
            return
        text = ", ".join(f"{k}={v:.4g}" for k, v in sorted(values.items()))
        stores = store.stats() if store is not None else {}
        logger.info("chunk reuse (%s): %s; stores: %s", self.side, text, stores)


@dataclass
class ChunkReuseStats(KVConnectorStats):
    """Per-interval increments of the worker's counters (summed across workers and steps)."""

    data: dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0.0) + value
        return ChunkReuseStats(merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


class ChunkReusePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        names = {f"vllm:chunk_reuse_{name}": v for name, v in PROM_COUNTERS.items()}
        for name, (key, text) in (names | faults.PROM_COUNTERS).items():
            counter = self._counter_cls(name=name, documentation=text, labelnames=labelnames)
            self._counters[key] = {engine: counter.labels(*values)
                                   for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0.0)
            if value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
