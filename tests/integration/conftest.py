"""Integration tests start real vLLM CPU engines, one at a time, each in its own process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from vllm_accel.bench.harness import engine_settings, run_side

# one-worker engines run their engine core and CPU worker inside the engine's process
# (run_side): these tests check outputs, not timings, and skip two vLLM start-ups per engine
os.environ.setdefault("VLLM_ACCEL_ENGINE_IN_PROCESS", "1")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.integration)


@pytest.fixture
def generate(tmp_path):
    """generate(label, model_dir, prompts_ids, max_tokens, sequential=True, ignore_eos=False,
    **engine) -> (outputs, log text); ``sequential=False`` sends all prompts as one batch,
    ``ignore_eos=True`` always generates ``max_tokens`` tokens (random-weight models may emit
    their EOS token at any step)."""

    def run(label: str, model_dir: str, prompts: list[list[int]], max_tokens: int,
            sequential: bool = True, ignore_eos: bool = False,
            **engine: Any) -> tuple[list[dict[str, Any]], str]:
        settings = engine_settings(model_dir, 2048, 0.2, engine)
        task = {"kind": "generate", "name": "out", "prompts": prompts, "max_tokens": max_tokens,
                "sequential": sequential, "ignore_eos": ignore_eos}
        result = run_side(label, settings, [task], timeout_s=900, log_dir=tmp_path,
                          deterministic_batches=not sequential)
        return result["tasks"]["out"], Path(tmp_path, f"{label}.log").read_text()

    return run
