"""Counters of the chunk-reuse connector, logged periodically (and at shutdown) with the stores'
own counters: requests with chunks, hit/miss/claimed tokens, bytes loaded and saved, recompute
work (token-layers recomputed vs claimed), load failures, markup errors, store latency."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

from vllm_accel.log import get_logger

logger = get_logger("kv_connector")
LOG_INTERVAL_S = 10.0


class ReuseCounters:
    def __init__(self, side: str):
        self.side = side
        self._values: dict[str, float] = defaultdict(float)
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

    def maybe_log(self, store: Any = None, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_log < LOG_INTERVAL_S:
            return
        self._last_log = now
        values = self.snapshot()
        if not values:
            return
        text = ", ".join(f"{k}={v:.4g}" for k, v in sorted(values.items()))
        stores = store.stats() if store is not None else {}
        logger.info("chunk reuse (%s): %s; stores: %s", self.side, text, stores)
