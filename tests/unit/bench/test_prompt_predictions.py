"""The ``prompt_predictions`` worker task and the agreement it feeds into a bench result."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_accel.bench import engine_worker, harness  # noqa: E402


class _FakeEngine:
    """Finishes every request in one step with vLLM-shaped prompt log-probabilities."""

    def __init__(self, per_prompt):
        self.per_prompt, self.pending = per_prompt, []

    def add_request(self, rid, prompt, params):
        assert params.prompt_logprobs == 1
        self.pending.append(rid)

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        outs = []
        for rid in self.pending:
            entries = self.per_prompt[int(rid.split("-")[1])]
            outs.append(SimpleNamespace(
                request_id=rid, finished=True, num_cached_tokens=0, prompt_logprobs=entries,
                outputs=[SimpleNamespace(token_ids=[0], text="x", logprobs=None)]))
        self.pending = []
        return outs


def _lp(logprob, rank):
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_prompt_predictions_reads_prompt_token_logprob_and_rank1_token():
    # prompt [7, 8, 9]: position 1 predicts 8 (the model's top token is 5), position 2 predicts 9
    entries = [None, {8: _lp(-2.0, 3), 5: _lp(-0.5, 1)}, {9: _lp(-0.1, 1)}]
    out = engine_worker._prompt_predictions(_FakeEngine([entries]), [[7, 8, 9]])
    assert out == [{"logprobs": [None, -2.0, -0.1], "top1": [None, 5, 9]}]


def test_compare_reports_agreement_of_the_perplexity_task():
    side = {"by_prompt_length": {512: {"ttft_s": 1.0, "tpot_s": 0.1, "kv_blocks": 4}},
            "throughput_tok_s": None, "needle_accuracy": None, "retrieval": {},
            "retrieval_by_case": [], "perplexity": 2.0}
    base_raw = {"tasks": {"perplexity": [{"logprobs": [None, -1.0, -1.0], "top1": [None, 1, 2]}]}}
    accel_raw = {"tasks": {"perplexity": [{"logprobs": [None, -1.5, -1.0], "top1": [None, 1, 3]}]}}
    _, quality = harness.compare(side, side, base_raw, accel_raw)
    assert quality["top1_agreement"] == pytest.approx(0.5)
    assert quality["mean_abs_logprob_delta"] == pytest.approx(0.25)


def test_compare_without_the_latency_task_reports_quality_only():
    """``--set tasks=needle,retrieval``: no prompt-length rows, no speed ratios."""
    side = {"by_prompt_length": {}, "throughput_tok_s": None, "needle_accuracy": 0.9,
            "retrieval": {"multikey": 1.0},
            "retrieval_by_case": [{"kind": "multikey", "length": 512, "score": 1.0}],
            "perplexity": None}
    ratios, quality = harness.compare(side, {**side, "needle_accuracy": 0.8},
                                      {"tasks": {}}, {"tasks": {}})
    assert "ttft_speedup" not in ratios and ratios["throughput_ratio"] is None
    assert quality["needle_baseline"] == 0.9 and quality["needle_accelerated"] == 0.8
    assert quality["multikey_accelerated"] == 1.0
