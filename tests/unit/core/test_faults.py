"""vllm_accel.faults: fault counters and the VLLM_ACCEL_INJECT_FAULTS failpoints."""

from __future__ import annotations

import pytest

from vllm_accel import faults


def test_parse_rates_accepts_known_points_and_names_the_variable_otherwise():
    assert faults.parse_rates("") == {}
    assert faults.parse_rates("proposer=0.25") == {"proposer": 0.25}
    with pytest.raises(ValueError, match="VLLM_ACCEL_INJECT_FAULTS=.*one of proposer"):
        faults.parse_rates("scheduler=0.1")
    with pytest.raises(ValueError, match="must be a probability"):
        faults.parse_rates("proposer=2")


def test_maybe_inject_raises_at_the_configured_rate(monkeypatch):
    monkeypatch.setattr(faults, "_rates", {})
    faults.maybe_inject("proposer")  # unset: never raises
    monkeypatch.setattr(faults, "_rates", {"proposer": 1.0})
    with pytest.raises(faults.InjectedFault, match="proposer"):
        faults.maybe_inject("proposer")
    monkeypatch.setattr(faults, "_rates", {"proposer": 0.3})
    raised = 0
    for _ in range(2000):
        try:
            faults.maybe_inject("proposer")
        except faults.InjectedFault:
            raised += 1
    assert 450 < raised < 750


def test_increments_are_counted_once():
    faults.take_increments()
    faults.record("proposer_errors")
    faults.record("proposer_errors", 2)
    assert faults.take_increments() == {"proposer_errors": 3}
    assert faults.take_increments() == {}
    assert faults.totals()["proposer_errors"] >= 3
