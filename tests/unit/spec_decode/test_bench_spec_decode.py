"""The spec-decode benchmark's bookkeeping (no engine): metrics, ratios, table, CLI errors."""

from __future__ import annotations

import json

import pytest

from vllm_accel import cli
from vllm_accel.bench import spec_decode
from vllm_accel.bench.spec_workloads import Workload


def _result(tpot: float, accepted: int, drafts: int, drafted: int, tokens=(1, 2, 3, 4, 5)):
    records = [{"output_tokens": 5, "ttft_s": 0.5, "tpot_s": tpot, "token_ids": list(tokens)}
               for _ in range(2)]
    spec = {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted}
    return {"vllm_version": "0.32.0", "platform": {"device": "cpu", "cpus": 2},
            "tasks": {"code_edit": records, "open_chat": records},
            "spec_decoding": {"by_task": {"code_edit": spec, "open_chat": spec}}}


def test_metrics_ratios_and_table(tmp_path):
    workloads = [Workload("code_edit", [[1]], True), Workload("open_chat", [[1]], False)]
    raw = {"no_spec": [_result(0.1, 0, 0, 0)],
           "ngram": [_result(0.05, 4, 2, 8)],
           "sam": [_result(0.04, 6, 2, 6, tokens=(1, 2, 3, 4, 9))]}
    table, ratios = spec_decode.compare(raw, workloads, eos_ids=frozenset({9}))
    sam = table["code_edit"]["sam"]
    assert sam["mean_accepted_length"] == 4.0 and sam["acceptance_rate"] == 1.0
    assert sam["tokens_per_step"] == 8 / 2  # 8 decoded tokens in 2 steps
    assert sam["tpot_s"] == pytest.approx(0.04)
    assert sam["greedy_identical"] == 0.0 and sam["ended_before_limit"] == 1.0
    assert table["code_edit"]["no_spec"]["mean_accepted_length"] is None
    assert ratios["decode_speedup"]["code_edit"] == pytest.approx(2.5)
    assert ratios["decode_speedup_vs_ngram"] == {"code_edit": pytest.approx(1.25)}
    assert ratios["open_chat_slowdown"] == pytest.approx(-1.5)
    result = {"model": "m", "vllm_version": "0.32.0", "platform": raw["no_spec"][0]["platform"],
              "config": {"plan": {"num_speculative_tokens": 8, "prompts_per_workload": 1,
                                  "max_tokens": 5, "rounds": 1}},
              "workloads": table, "ratios": ratios, "notes": [spec_decode.SUFFIX_NOTE]}
    text = spec_decode.table(result)
    assert "code_edit" in text and "2.50x" in text and "arctic-inference" in text
    pytest.importorskip("matplotlib")
    spec_decode.write_plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(result)


def test_configs_compare_like_with_like():
    c = spec_decode.configs(6, {"min_match": 4})
    assert c["no_spec"] == {}
    assert c["ngram"]["speculative_config"]["num_speculative_tokens"] == 6
    assert c["sam"]["speculative_config"] == {
        "method": "custom_class", "model": "vllm_accel.spec_decode.SAMProposer",
        "num_speculative_tokens": 6}
    assert c["sam"]["additional_config"] == {"vllm_accel": {"spec_decode": {"min_match": 4}}}
    assert spec_decode.bench_dtype("bfloat16") == "bfloat16"


def test_bench_spec_decode_unknown_model(capsys):
    assert cli.main(["bench", "spec-decode", "--model", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown model 'nope'" in err


def test_headline_ratios_use_the_best_vllm_accel_proposer(tmp_path):
    workloads = [Workload("code_edit", [[1]], True), Workload("open_chat", [[1]], False)]
    raw = {"no_spec": [_result(0.1, 0, 0, 0)], "ngram": [_result(0.05, 4, 2, 8)],
           "sam": [_result(0.04, 6, 2, 6)], "recycling": [_result(0.08, 2, 2, 4)],
           "hybrid": [_result(0.025, 7, 2, 8)]}
    table, ratios = spec_decode.compare(raw, workloads)
    assert set(table["code_edit"]) == {"no_spec", "ngram", "sam", "recycling", "hybrid"}
    assert ratios["best_proposer"] == {"code_edit": "hybrid", "open_chat": "hybrid"}
    assert ratios["decode_speedup"]["code_edit"] == pytest.approx(4.0)
    assert ratios["decode_speedup_vs_ngram"]["code_edit"] == pytest.approx(2.0)
    assert ratios["decode_speedup_by_proposer"]["recycling"]["code_edit"] == pytest.approx(1.25)
    assert ratios["decode_speedup_by_proposer"]["sam"]["open_chat"] == pytest.approx(2.5)
    result = {"model": "m", "vllm_version": "0.32.0", "platform": raw["no_spec"][0]["platform"],
              "config": {"plan": {"num_speculative_tokens": 8, "prompts_per_workload": 1,
                                  "max_tokens": 5, "rounds": 1}},
              "workloads": table, "ratios": ratios, "notes": [spec_decode.SUFFIX_NOTE]}
    assert "4.00x (hybrid)" in spec_decode.table(result)
    pytest.importorskip("matplotlib")
    spec_decode.write_plot(result, tmp_path / "p.png")


def test_every_vllm_accel_proposer_is_a_configuration():
    c = spec_decode.configs(8)
    for label, cls in (("recycling", "RecyclingProposer"), ("hybrid", "HybridProposer")):
        assert c[label]["speculative_config"] == {
            "method": "custom_class", "model": f"vllm_accel.spec_decode.{cls}",
            "num_speculative_tokens": 8}
        assert "additional_config" not in c[label]


def test_set_picks_configurations_and_workloads(capsys):
    from vllm_accel.bench.features import plan_with_overrides

    plan = plan_with_overrides(spec_decode.QUICK, ["configs=sam,hybrid", "workloads=open_chat",
                                                   "rounds=2"])
    assert (plan.configs, plan.workloads, plan.rounds) == (("sam", "hybrid"), ("open_chat",), 2)
    with pytest.raises(ValueError, match="configs: unknown \\['eagle'\\]"):
        plan_with_overrides(spec_decode.QUICK, ["configs=eagle"])
    assert cli.main(["bench", "spec-decode", "--set", "workloads=chess"]) == 2
    assert "workloads: unknown ['chess']" in capsys.readouterr().err


def test_ratios_without_ngram():
    workloads = [Workload("code_edit", [[1]], True), Workload("open_chat", [[1]], False)]
    raw = {"no_spec": [_result(0.1, 0, 0, 0)], "hybrid": [_result(0.05, 7, 2, 8)]}
    _, ratios = spec_decode.compare(raw, workloads)
    assert ratios["decode_speedup"] == {"code_edit": pytest.approx(2.0),
                                        "open_chat": pytest.approx(2.0)}
    assert ratios["decode_speedup_vs_ngram"] == {} and ratios["ngram_decode_speedup"] == {}
