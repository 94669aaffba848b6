"""Shared test fixtures: the tiny random model, the real default model, CPU thread settings."""

from __future__ import annotations

import os

# Triton kernels are tested in the CPU interpreter. Triton reads this when kernels are
# decorated, and vLLM imports triton early, so it must be set before anything is imported.
# Engines started by the tests get an environment without it (vllm_accel.cpu_env.engine_env).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from vllm_accel.cpu_env import apply_cpu_thread_env  # noqa: E402

apply_cpu_thread_env()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from vllm_accel.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama"))


@pytest.fixture(scope="session")
def default_model() -> str:
    """The real embedded default model; `make test` fetches it before pytest starts."""
    from vllm_accel.models import DEFAULT_MODEL, ModelNotFetchedError, model_path

    try:
        return str(model_path(DEFAULT_MODEL))
    except ModelNotFetchedError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
