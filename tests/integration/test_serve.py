"""`vllm-accel serve` (vLLM's own `serve` CLI) answers OpenAI requests with ACCEL_BASE on CPU."""

from __future__ import annotations

import pytest

from vllm_accel.bench.server import post_json, served


@pytest.mark.real_model
def test_serve_answers_a_completion_with_accel_base(default_model, tmp_path):
    # float32: vLLM 0.32's own bf16 CPU path answers wrongly on some CPUs (Intel AMX).
    args = ["--attention-backend", "ACCEL_BASE", "--served-model-name", "smollm2",
            "--dtype", "float32"]
    with served(default_model, args, tmp_path / "serve.log") as server:
        base = server.api
        completion = post_json(f"{base}/completions", {
            "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0})
        assert "Paris" in completion["choices"][0]["text"]
        chat = post_json(f"{base}/chat/completions", {
            "model": "smollm2", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert "Paris" in chat["choices"][0]["message"]["content"]
        assert "Using ACCEL_BASE backend on CPU" in (tmp_path / "serve.log").read_text()
