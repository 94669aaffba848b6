"""The short soak of `make test`: the OpenAI server with the largest composable feature set
(sparse prefill + chunk reuse + HybridProposer, prefix caching, chunked prefill) under a mixed
load with streaming and client cancellations (vllm_accel/bench/soak.py). The long soak next to
plain vLLM is `vllm-accel soak` (docs/serving.md)."""

from __future__ import annotations

import pytest

from vllm_accel.bench import soak

pytestmark = pytest.mark.real_model


def test_short_soak_with_every_composable_feature(default_model, tmp_path):
    report = soak.run(default_model, requests=48, concurrency=8, sides=("accel",),
                      log_dir=tmp_path)
    accel = report["accel"]
    assert accel["errors"] == 0, accel["first_errors"]
    assert accel["cancelled"] > 0 and accel["finished"] >= 36
    assert accel["probe_stable"], (accel["probe_before"], accel["probe_after"])
    metrics = accel["metrics"]
    assert metrics["vllm:chunk_reuse_reused_requests_total"] > 0
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert "first sparse prefill of this process" in (tmp_path / "soak-accel.log").read_text()
    # the memory tier is bounded at 0.25 GiB; nothing else may grow with the requests
    assert accel["memory"]["growth_after_settled_mib"] < 256, accel["memory"]
