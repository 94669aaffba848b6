"""CPU thread binding for engines the tools start: all cores, split per tensor-parallel rank."""

from __future__ import annotations

import pytest

from vllm_accel import cpu_env


@pytest.mark.parametrize("cores, ranks, want", [
    (2, 1, "0-1"), (2, 2, "0|1"), (4, 2, "0-1|2-3"), (5, 2, "0-1|2-4"), (1, 1, "0")])
def test_core_ranges_split_the_cores(monkeypatch, cores, ranks, want):
    monkeypatch.setattr(cpu_env, "_num_cores", lambda: cores)
    assert cpu_env.core_ranges(ranks) == want


def test_more_ranks_than_cores_is_an_error(monkeypatch):
    monkeypatch.setattr(cpu_env, "_num_cores", lambda: 2)
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 needs at least 3 CPU cores"):
        cpu_env.core_ranges(3)


def test_engine_env_fits_the_binding_to_the_ranks(monkeypatch):
    monkeypatch.setattr(cpu_env, "_num_cores", lambda: 2)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert cpu_env.engine_env()["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert cpu_env.engine_env(ranks=2)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # vLLM's own choice: kept
    assert cpu_env.engine_env(ranks=2)["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
