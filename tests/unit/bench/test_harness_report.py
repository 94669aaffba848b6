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
