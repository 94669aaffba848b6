"""A throw-away ``redis-server`` (loopback, no persistence) for the Redis chunk-store tests, the
fault run and the two-instance sharing test; it can be killed and started again on its port."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from vllm_accel.bench.server import free_port


def available() -> bool:
    return shutil.which("redis-server") is not None


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("needs redis-server on PATH (e.g. apt-get install redis-server)")
        self.port = port or free_port()
        self._dir = tempfile.mkdtemp(prefix="vllm-accel-redis-")
        self.cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", self._dir]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def start(self, timeout_s: float = 10.0) -> None:
        import redis

        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(redis.ConnectionError):
                if self.client().ping():
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def flush(self) -> None:
        self.client().flushall()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def redis_server(port: int | None = None) -> Iterator[RedisServer]:
    server = RedisServer(port)
    server.start()
    try:
        yield server
    finally:
        server.close()
