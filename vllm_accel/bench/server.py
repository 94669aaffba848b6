"""An OpenAI-compatible vLLM server in a child process, for tests, the soak and the fault run.

:func:`served` starts ``vllm-accel serve MODEL`` (vLLM's own ``serve`` CLI, with the CPU build's
console-script crash worked around) on a free loopback port, waits until ``/health`` answers,
yields a :class:`Server`, and stops the whole process group on exit. :func:`engine_flags` turns
an engine dict of the bench harness (``LLM(**engine)`` keyword arguments) into the matching
``vllm serve`` flags, so one feature configuration drives both.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_accel.cpu_env import engine_env


class ServerError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(engine: dict[str, Any]) -> list[str]:
    """``{"attention_backend": "X", "enable_prefix_caching": False, "kv_transfer_config": {...}}``
    -> ``["--attention-backend", "X", "--no-enable-prefix-caching", "--kv-transfer-config",
    "{...}"]``: dicts become JSON, booleans become (``--no-``) switches."""
    flags: list[str] = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif value is not None:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def read_metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}`` (one entry per Prometheus sample line)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                samples[name] = float(value)
    return samples


def metric_total(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process under it (engine core, workers)."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                total += proc.memory_info().rss
        return total


@contextlib.contextmanager
def served(model: str, args: list[str], log_path: str | Path, max_model_len: int = 2048,
           gpu_memory_utilization: float = 0.2, startup_timeout_s: float = 600,
           env: dict[str, str] | None = None) -> Iterator[Server]:
    """``vllm-accel serve MODEL ARGS`` on a free loopback port until healthy."""
    log_path = Path(log_path)
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_accel.cli", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--gpu-memory-utilization", str(gpu_memory_utilization),
           "--max-model-len", str(max_model_len), "--enforce-eager", *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**engine_env(), **(env or {})})
        server = Server(f"http://127.0.0.1:{port}", proc, log_path)
        try:
            deadline = time.monotonic() + startup_timeout_s
            while True:
                if proc.poll() is not None:
                    raise ServerError(f"the server exited with {proc.returncode} at start-up:\n"
                                      f"{server.log_text()[-3000:]}")
                try:
                    urllib.request.urlopen(f"{server.url}/health", timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise ServerError(f"not healthy after {startup_timeout_s:.0f} s:\n"
                                          f"{server.log_text()[-3000:]}") from None
                    time.sleep(2)
            yield server
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
