"""Redis chunk store: checksummed blobs (see :mod:`.serialization`) under ``key_prefix + key``.

Shared by every engine that points at the same server. A dead or unreachable server costs at
most about ``timeout_s`` per call (no client-side retries); after a failure the store does not
touch the network for ``backoff_s`` seconds, and every call meanwhile is a counted error.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from vllm_accel.kv_connector.stores.serialization import BlobStore


class RedisUnavailableError(ConnectionError):
    """The server failed recently; calls are refused until the back-off ends."""


class RedisStore(BlobStore):
    def __init__(
        self,
        url: str,
        timeout_s: float = 1.0,
        key_prefix: str = "vllm_accel:chunk:",
        ttl_s: float | None = None,
        backoff_s: float = 5.0,
        name: str = "redis",
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise ImportError(
                "the Redis chunk store needs redis-py: pip install redis (or pip install hiredis "
                "redis for the faster parser)"
            ) from exc
        super().__init__(name)
        self.url = url
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.backoff_s = backoff_s
        # Connecting is lazy: a server that is down now costs nothing here.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # one attempt per call; back-off is ours (below)
        )
        self._network_errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._down_until = 0.0
        self._lock = threading.Lock()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if time.monotonic() < self._down_until:
                raise RedisUnavailableError(f"{self.url} failed recently; retrying later")
        try:
            return getattr(self._client, method)(*args, **kwargs)
        except self._network_errors:  # other errors (e.g. OOM on SET) do not mean "down"
            with self._lock:
                self._down_until = time.monotonic() + self.backoff_s
            raise

    def _read(self, key: str) -> bytes | None:
        return self._call("get", self.key_prefix + key)

    def _write(self, key: str, blob: bytes) -> bool:
        ttl_ms = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))
        self._call("set", self.key_prefix + key, blob, px=ttl_ms)
        return True

    def _exists(self, key: str) -> bool:
        return bool(self._call("exists", self.key_prefix + key))

    def _discard(self, key: str) -> None:
        self._call("delete", self.key_prefix + key)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()
