"""`bench --set rounds=N`: baseline and accelerated engines alternate, latency pools the rounds."""

from __future__ import annotations

import pytest

from vllm_accel.bench import harness, report
from vllm_accel.bench.features import BenchPlan, FeatureBench
from vllm_accel.bench.workloads import Workloads

LATENCY = {"kind": "latency", "name": "latency", "prompts": [[1] * 8, [1] * 16],
           "max_tokens": 4}
NEEDLE = {"kind": "generate", "name": "needle", "prompts": [[2] * 8], "max_tokens": 4}


def _fake_side(calls: list[tuple[str, list[str]]]):
    """run_side stand-in: the accelerated engine is 2x faster in TTFT, and its TPOT ratio
    drifts by round (1.2x, then 0.9x), as timings on a shared machine do."""
    tpot_ratio = {0: 1.2, 1: 0.9}

    def run_side(label, engine, tasks, *args, **kwargs):
        calls.append((label, [t["name"] for t in tasks]))
        round_index = sum(1 for name, _ in calls if name.split(".")[0] == label.split(".")[0]) - 1
        accelerated = label.startswith("accelerated")
        latency = []
        for prompt in LATENCY["prompts"]:
            ttft, tpot = 0.1 * len(prompt), 0.02
            if accelerated:
                ttft, tpot = ttft / 2, tpot / tpot_ratio[round_index]
            latency.append({"prompt_tokens": len(prompt), "ttft_s": ttft, "tpot_s": tpot,
                            "kv_blocks": 1, "kv_usage": 0.01})
        out = {"tasks": {"latency": latency}, "load_s": 1.0, "num_kv_blocks": 100,
               "block_size": 16, "vllm_version": "0.32.0"}
        if any(t["name"] == "needle" for t in tasks):
            out["tasks"]["needle"] = [{"text": ""}]
        return out

    return run_side


def test_rounds_alternate_sides_and_pool_latency(monkeypatch, tmp_path):
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(harness, "run_side", _fake_side(calls))
    monkeypatch.setattr(harness, "build", lambda tok, plan: Workloads(
        [LATENCY, NEEDLE], [], [], max_model_len=64))
    monkeypatch.setattr("vllm_accel.quality.prompts.load_tokenizer", lambda d: None)
    feature = FeatureBench(name="f", summary="s", model="m", accelerated={"x": 1})
    result = harness.run_feature(feature, BenchPlan(rounds=2), "/m", "m", 0.5, tmp_path)

    # B A B A; the quality task runs in the first round only
    assert calls == [("baseline", ["latency", "needle"]), ("accelerated", ["latency", "needle"]),
                     ("baseline.round2", ["latency"]), ("accelerated.round2", ["latency"])]
    by_round = result["ratios_by_round"]
    assert [r[16]["tpot_speedup"] for r in by_round] == pytest.approx([1.2, 0.9])
    assert [r[16]["ttft_speedup"] for r in by_round] == pytest.approx([2.0, 2.0])
    # medians pool both rounds: the accelerated side's TPOT median is the mean of the two
    pooled = result["accelerated"]["by_prompt_length"][16]["tpot_s"]
    assert pooled == pytest.approx((0.02 / 1.2 + 0.02 / 0.9) / 2)
    assert result["ratios"]["tpot_speedup"] == pytest.approx(0.02 / pooled)
    text = report.table({**result, "platform": {}})
    assert "by round @ 16 tok (TTFT, TPOT speedup): 2.000, 1.200; 2.000, 0.900" in text


def test_one_round_has_no_round_table(monkeypatch, tmp_path):
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(harness, "run_side", _fake_side(calls))
    monkeypatch.setattr(harness, "build", lambda tok, plan: Workloads(
        [LATENCY], [], [], max_model_len=64))
    monkeypatch.setattr("vllm_accel.quality.prompts.load_tokenizer", lambda d: None)
    feature = FeatureBench(name="f", summary="s", model="m", accelerated={"x": 1})
    result = harness.run_feature(feature, BenchPlan(), "/m", "m", 0.5, tmp_path)
    assert [label for label, _ in calls] == ["baseline", "accelerated"]
    assert "ratios_by_round" not in result


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="rounds"):
        BenchPlan(rounds=0).check()
