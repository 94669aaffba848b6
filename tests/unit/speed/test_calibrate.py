"""``vllm-accel calibrate speed``: choosing the cut, and the CLI's argument checks."""

from __future__ import annotations

from vllm_accel.cli import main
from vllm_accel.speed.calibrate import CutResult, recommend


def _r(cut, lower, needle, ppl, multikey=None):
    return CutResult(cut, lower, needle, ppl, 1 - lower / 24, 1 - lower / 24, multikey)


def test_recommends_the_lowest_cut_that_keeps_quality():
    results = [_r(1.0, 24, 1.0, 10.0), _r(0.875, 21, 1.0, 10.4), _r(0.75, 18, 1.0, 10.6),
               _r(0.625, 15, 0.5, 11.0)]
    assert recommend(results, ppl_tolerance=0.05) == 0.875  # 0.75 is +6 % perplexity
    assert recommend(results, ppl_tolerance=0.07) == 0.75  # 0.625 loses needles
    assert recommend([_r(1.0, 24, 1.0, 10.0), _r(0.5, 12, 0.0, 30.0)], 0.05) == 1.0
    assert recommend([], 0.05) is None
    with_keys = [_r(1.0, 24, 1.0, 10.0, 1.0), _r(0.875, 21, 1.0, 10.1, 1.0),
                 _r(0.75, 18, 1.0, 10.2, 0.5)]
    assert recommend(with_keys, ppl_tolerance=0.05) == 0.875  # 0.75 loses multi-key answers


def test_table_shows_multikey():
    from vllm_accel.speed.calibrate import CalibrationPlan, table

    report = {"model": "m", "num_layers": 24, "plan": {"ppl_tolerance": 0.05},
              "results": [vars(_r(1.0, 24, 1.0, 10.0, 0.75))], "recommended_cut": 1.0}
    assert "multi-key" in table(report) and "0.75" in table(report)
    assert CalibrationPlan().multikey_samples > 0


def test_cli_rejects_cuts_outside_0_1(capsys):
    assert main(["calibrate", "speed", "--cuts", "0.5,1.5"]) == 2
    assert "--cuts 0.5,1.5" in capsys.readouterr().err
    assert main(["calibrate", "speed", "--cuts", "x"]) == 2
