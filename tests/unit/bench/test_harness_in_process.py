"""run_side puts one-worker engines in one process when asked (VLLM_ACCEL_ENGINE_IN_PROCESS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_accel.bench import harness


def _worker_env(monkeypatch, tmp_path: Path, engine: dict, **kwargs) -> dict:
    """The environment run_side hands the engine worker (through its spec file)."""
    seen = {}

    def fake_run(argv, stdout, stderr, env, timeout):
        spec_path, out_path = argv[-2:]
        seen.update(json.loads(Path(spec_path).read_text())["env"])
        Path(out_path).write_text("{}")

        class Done:
            returncode = 0
        return Done()

    monkeypatch.setattr(harness.subprocess, "run", fake_run)
    harness.run_side("side", engine, [], timeout_s=10, log_dir=tmp_path, **kwargs)
    return seen


@pytest.mark.parametrize("flag, tp, batches, in_process", [
    (None, 1, False, False),  # vLLM's default: engine core and worker in their own processes
    (None, 1, True, True),  # deterministic batches need the engine core in the worker process
    ("1", 1, False, True),
    ("0", 1, False, False),
    ("1", 2, False, False),  # two workers keep vLLM's multiprocessing
])
def test_in_process_engine(monkeypatch, tmp_path, flag, tp, batches, in_process):
    if flag is None:
        monkeypatch.delenv("VLLM_ACCEL_ENGINE_IN_PROCESS", raising=False)
    else:
        monkeypatch.setenv("VLLM_ACCEL_ENGINE_IN_PROCESS", flag)
    env = _worker_env(monkeypatch, tmp_path, {"tensor_parallel_size": tp},
                      deterministic_batches=batches)
    assert (env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0") == in_process
