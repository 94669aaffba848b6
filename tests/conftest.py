"""Shared test fixtures: the tiny random model, the real default model, CPU thread settings."""

from __future__ import annotations

import os

import pytest

from vllm_accel.cpu_env import apply_cpu_thread_env

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
