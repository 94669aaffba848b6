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


def test_adapted_models_are_evaluated_at_their_own_cut(tiny_llama, tmp_path):
    """The same cases for the untuned curve and each adapted model (at the cut in its config);
    a model without the adapted key is refused."""
    import json
    import shutil

    import pytest

    from vllm_accel.quality.prompts import load_tokenizer
    from vllm_accel.speed.calibrate import (
        CalibrationPlan,
        build_code_documents,
        calibrate,
        table,
        write_plot,
    )
    from vllm_accel.speed.config import ADAPTED_CONFIG_KEY

    adapted = tmp_path / "adapted"
    shutil.copytree(tiny_llama, adapted)
    config = json.loads((adapted / "config.json").read_text())
    config[ADAPTED_CONFIG_KEY] = {"cut": 0.5, "anchor_tokens": 1}
    (adapted / "config.json").write_text(json.dumps(config))
    plan = CalibrationPlan(cuts=(1.0, 0.5), needle_length=256, needles_per_depth=1,
                           multikey_length=256, multikey_samples=1, ppl_prompt_tokens=64,
                           ppl_continuation_tokens=8, code_samples=2, code_prompt_tokens=64,
                           code_continuation_tokens=8)
    code = build_code_documents(load_tokenizer(tiny_llama), plan)
    assert [(len(p), len(c)) for p, c in code] == [(64, 8), (64, 8)]
    report = calibrate(tiny_llama, plan, adapted=(str(adapted),), log=lambda *_: None)
    rows = [(r["model"], r["cut"], r["num_lower_layers"]) for r in report["results"]]
    assert rows == [("untuned", 1.0, 4), ("untuned", 0.5, 2), ("adapted", 0.5, 2)]
    untuned, same = report["results"][1], report["results"][2]
    # Identical weights here, so the adapted row must reproduce the untuned one exactly.
    assert same["perplexity"] == untuned["perplexity"] and same["answers"] == untuned["answers"]
    assert same["code_perplexity"] == untuned["code_perplexity"] > 1
    assert "adapted" in table(report)
    write_plot(report, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 0
    skip = calibrate(tiny_llama, CalibrationPlan(cuts=(0.5,), needles_per_depth=0,
                                                 multikey_samples=0, ppl_documents=0,
                                                 code_samples=1, code_prompt_tokens=64,
                                                 code_continuation_tokens=8),
                     log=lambda *_: None)["results"][0]
    assert skip["needle_accuracy"] is None and skip["perplexity"] is None
    assert skip["code_perplexity"] > 1
    with pytest.raises(ValueError, match="not a SPEED-adapted model"):
        calibrate(tiny_llama, plan, adapted=(tiny_llama,), log=lambda *_: None)
