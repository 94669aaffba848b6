"""vllm_accel features under vLLM's own tensor parallelism: ``--tensor-parallel-size 2`` on this
2-core CPU (one core per worker; the harness splits ``VLLM_CPU_OMP_THREADS_BIND`` per rank),
tiny random Llama in float32, greedy tokens equal to one worker's. Features that do not run
with several workers yet refuse at start-up (vllm_accel/composition.py, TENSOR_PARALLEL; the
refusal is unit-tested, and reaches the engine through the same check as the refused pairs of
tests/integration/test_composition.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.test_spec_decode import sam_engine
from vllm_accel.bench.harness import engine_settings, run_side

PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((40, 300))]


@pytest.fixture
def tokens(tiny_llama, tmp_path):
    def run(label: str, tensor_parallel_size: int, **features: Any) -> list[list[int]]:
        engine = engine_settings(tiny_llama, 512, 0.2, {
            "dtype": "float32", "tensor_parallel_size": tensor_parallel_size, **features})
        task = {"kind": "generate", "name": "out", "prompts": PROMPTS, "max_tokens": 16,
                "sequential": True, "ignore_eos": True}
        result = run_side(f"{label}-tp{tensor_parallel_size}", engine, [task], timeout_s=900,
                          log_dir=tmp_path)
        return [o["token_ids"] for o in result["tasks"]["out"]]

    return run


def test_speed_matches_one_worker(tokens):
    speed = {"attention_backend": "ACCEL_SPEED",
             "additional_config": {"vllm_accel": {"speed": {"cut": 0.5}}}}
    assert tokens("speed", 2, **speed) == tokens("speed", 1, **speed)


def test_sparse_prefill_and_proposer_match_one_worker(tokens):
    """Sparse prefill from 64 tokens of context (the 300-token prompt uses it) and SAMProposer
    drafts, in one engine."""
    features = {"attention_backend": "ACCEL_SPARSE_PREFILL",
                "additional_config": {"vllm_accel": {"sparse_prefill": {"threshold": 64}}},
                **sam_engine(4)}
    assert tokens("sparse+proposer", 2, **features) == tokens("sparse+proposer", 1, **features)

