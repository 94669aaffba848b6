"""Each test starts with no KIVI layer built in this process (the backend remembers the knobs
of the layers it built for vLLM's config-less calls: they must not leak between tests)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_built_knobs(monkeypatch):
    from vllm_accel.kv_quant import backend

    monkeypatch.setattr(backend, "_BUILT_FORMAT", {})
