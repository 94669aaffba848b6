"""The harness's side-by-side quality report."""

from __future__ import annotations

import doctest

import pytest

from vllm_accel.bench import harness
from vllm_accel.bench.harness import retrieval_case_changes, sign_test_p


def _cases(kind: str, scores: list[float]) -> list[dict]:
    return [{"kind": kind, "length": 4096, "score": s} for s in scores]


def test_retrieval_case_changes_counts_each_direction_per_kind():
    base = _cases("multivalue", [1 / 3, 2 / 3, 1.0, 0.0]) + _cases("multikey", [1.0, 0.0])
    accel = _cases("multivalue", [0.0, 2 / 3, 1 / 3, 1 / 3]) + _cases("multikey", [1.0, 0.0])
    assert retrieval_case_changes(base, accel) == {
        "multivalue_cases_worse": 2, "multivalue_cases_better": 1,
        "multivalue_sign_test_p": 1.0,
        "multikey_cases_worse": 0, "multikey_cases_better": 0, "multikey_sign_test_p": 1.0}


def test_sign_test_p_is_the_two_sided_binomial_tail():
    assert doctest.testmod(harness).failed == 0
    # 16 of 23 changed cases worse: P(X >= 16 | n=23, 1/2) = 390,656 / 2**23, doubled
    assert sign_test_p(16, 7) == pytest.approx(2 * 390656 / 2 ** 23)
    assert sign_test_p(7, 16) == sign_test_p(16, 7)
    assert sign_test_p(3, 3) == 1.0


def test_retrieval_case_changes_refuses_sides_with_different_cases():
    with pytest.raises(ValueError):
        retrieval_case_changes(_cases("multikey", [1.0, 0.0]), _cases("multikey", [1.0]))


def test_extra_sides_are_compared_case_by_case_with_the_baseline(monkeypatch, tmp_path):
    """An extra quality side (``--set extra_sides=true``) gets its own per-kind scores and
    cases worse/better against the baseline, and the table shows both."""
    from vllm_accel.bench import report
    from vllm_accel.bench.features import BenchPlan, FeatureBench
    from vllm_accel.bench.workloads import Workloads
    from vllm_accel.quality.retrieval import RetrievalCase

    cases = [RetrievalCase("multivalue", 64, ("11", "22"), [1] * 8),
             RetrievalCase("multivalue", 64, ("33", "44"), [2] * 8)]
    answers = {"baseline": ["11 22", "33"], "accelerated": ["11", "33"],
               "alt": ["11 22", "33 44"]}
    task = {"kind": "generate", "name": "retrieval", "prompts": [c.prompt_ids for c in cases],
            "max_tokens": 4}

    def run_side(label, engine, tasks, *args, **kwargs):
        assert [t["name"] for t in tasks] == ["retrieval"]
        return {"tasks": {"retrieval": [{"text": t} for t in answers[label]]}, "load_s": 1.0,
                "num_kv_blocks": 1, "block_size": 16, "vllm_version": "0.32.0"}

    monkeypatch.setattr(harness, "run_side", run_side)
    monkeypatch.setattr(harness, "build", lambda tok, plan: Workloads([task], [], cases, 64))
    monkeypatch.setattr("vllm_accel.quality.prompts.load_tokenizer", lambda d: None)
    feature = FeatureBench(name="f", summary="s", model="m", accelerated={"x": 1},
                           extra_sides=lambda plan, accel: {"alt": {"x": 2}})
    result = harness.run_feature(feature, BenchPlan(extra_sides=True), "/m", "m", 0.5, tmp_path)
    q = result["quality"]
    assert (q["multivalue_baseline"], q["multivalue_accelerated"], q["multivalue_alt"]) == (
        0.75, 0.5, 1.0)
    assert (q["multivalue_cases_worse"], q["multivalue_cases_better"]) == (1, 0)
    assert (q["multivalue_cases_worse_alt"], q["multivalue_cases_better_alt"]) == (0, 1)
    assert "alt: 1.000 (cases worse/better: 0/1)" in report.table({**result, "platform": {}})
