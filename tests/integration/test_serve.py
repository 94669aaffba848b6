"""`vllm-accel serve` (vLLM's own `serve` CLI) answers OpenAI requests with ACCEL_BASE on CPU."""

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

import pytest

from vllm_accel.cpu_env import engine_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@contextlib.contextmanager
def served(model: str, args: list[str], log_path):
    """``vllm-accel serve MODEL ARGS`` on a free port until healthy; yields the base URL."""
    port = _free_port()
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "vllm_accel.cli", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--gpu-memory-utilization", "0.2", "--max-model-len", "2048",
           "--enforce-eager", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=engine_env())
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            assert proc.poll() is None, open(log_path).read()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("server did not become healthy in 600 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.mark.real_model
def test_serve_answers_a_completion_with_accel_base(default_model, tmp_path):
    # float32: vLLM 0.32's own bf16 CPU path answers wrongly on some CPUs (Intel AMX).
    args = ["--attention-backend", "ACCEL_BASE", "--served-model-name", "smollm2",
            "--dtype", "float32"]
    with served(default_model, args, tmp_path / "serve.log") as url:
        base = f"{url}/v1"
        completion = _post(f"{base}/completions", {
            "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0})
        assert "Paris" in completion["choices"][0]["text"]
        chat = _post(f"{base}/chat/completions", {
            "model": "smollm2", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert "Paris" in chat["choices"][0]["message"]["content"]
        assert "Using ACCEL_BASE backend on CPU" in (tmp_path / "serve.log").read_text()
