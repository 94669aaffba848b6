"""The vllm-accel command: bad input gets one clear line and a non-zero exit."""

from __future__ import annotations

import json

import pytest

from vllm_accel import cli


def test_fetch_model_unknown_name(capsys):
    assert cli.main(["fetch-model", "llama-70b"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "unknown model 'llama-70b'" in err and "smollm2-135m-instruct" in err


def test_fetch_model_list(capsys):
    assert cli.main(["fetch-model", "--list"]) == 0
    assert "qwen2.5-coder-0.5b-instruct" in capsys.readouterr().out


def test_bench_unknown_feature(capsys):
    assert cli.main(["bench", "warp-drive"]) == 2
    assert "unknown feature 'warp-drive'" in capsys.readouterr().err


def test_bench_unknown_model(capsys):
    assert cli.main(["bench", "base", "--model", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


@pytest.fixture
def bench_sides(monkeypatch):
    """The engine settings of both sides a ``bench`` command would run (it stops there)."""
    from vllm_accel.bench import harness

    seen = {}

    def fake_run_feature(feature, *args):
        seen.update(baseline=feature.baseline, accelerated=feature.accelerated)
        raise harness.BenchError("stop here")

    monkeypatch.setattr(cli, "_model_dir_and_name", lambda model: ("/m", model))
    monkeypatch.setattr(harness, "run_feature", fake_run_feature)
    return seen


def test_bench_kv_cache_dtype_is_a_kv_quant_option(capsys, bench_sides):
    seen = bench_sides
    assert cli.main(["bench", "base", "--kv-cache-dtype", "kivi_2bit"]) == 2
    assert "--kv-cache-dtype applies to the kv-quant bench only" in capsys.readouterr().err
    assert cli.main(["bench", "kv-quant", "--quick", "--kv-cache-dtype", "kivi_2bit"]) == 1
    assert seen["accelerated"]["kv_cache_dtype"] == "kivi_2bit"
    assert seen["baseline"]["kv_cache_dtype"] == "auto"
    # same model dtype and KV-cache bytes on both sides: block counts compare capacity
    for key in ("dtype", "kv_cache_memory_bytes"):
        assert seen["accelerated"][key] == seen["baseline"][key]


def test_kv_quant_report_capacity_from_blocks():
    from vllm_accel.bench import kv_quant

    engine = {"kv_cache_memory_bytes": 1 << 20}
    base = {"num_kv_blocks": 4, "block_size": 128, "engine": engine, "perplexity": 10.0}
    quant = {"num_kv_blocks": 14, "block_size": 128, "engine": engine, "perplexity": 10.2}
    ratios, quality = kv_quant.report(base, quant)
    assert ratios["kv_capacity_ratio"] == pytest.approx(3.5)
    assert ratios["kv_bytes_per_token_baseline"] == pytest.approx((1 << 20) / 512)
    assert ratios["kv_tokens_quant"] == 14 * 128
    assert quality["ppl_bf16"] == 10.0 and quality["ppl_quant"] == 10.2
    assert quality["prefill_kv"] == "auto"
    # every format knob is recorded, so a report says which page format it measured
    assert quality["kv_quant"] == {"kernel": "auto", "residual": "tail", "prefill_kv": "auto",
                                   "prompt_exact_tokens": 8192, "key_group": 64,
                                   "value_group": 0, "sink_tokens": 0,
                                   "value_rotation": "auto"}


def test_kv_quant_report_records_the_knobs_the_engine_ran():
    from vllm_accel.bench import kv_quant

    engine = {"kv_cache_memory_bytes": 1 << 20,
              "additional_config": {"vllm_accel": {"kv_quant": {"key_group": 32,
                                                                "sink_tokens": 2}}}}
    side = {"num_kv_blocks": 4, "block_size": 128, "engine": engine, "perplexity": 10.0}
    _, quality = kv_quant.report(side, dict(side))
    assert quality["kv_quant"]["key_group"] == 32
    assert quality["kv_quant"]["sink_tokens"] == 2


def test_doctor_lists_backends_and_patches(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "backend ACCEL_BASE" in out
    assert "patch backend_enum_pickle" in out and "patch cpu_backend_selection" in out


def test_report_renders_table_json_and_plot(tmp_path):
    from vllm_accel.bench import report

    side = {"by_prompt_length": {512: {"ttft_s": 0.2, "tpot_s": 0.02, "kv_blocks": 5}},
            "throughput_tok_s": 100.0}
    result = {
        "feature": "base", "model": "m", "vllm_version": "0.32.0", "date": "today",
        "platform": {"device": "cpu", "cpus": 2},
        "baseline": side,
        "accelerated": {**side, "by_prompt_length": {
            512: {"ttft_s": 0.1, "tpot_s": 0.02, "kv_blocks": 4}}},
        "ratios": {"ttft_speedup": 2.0, "tpot_speedup": 1.0, "throughput_ratio": 1.0,
                   "kv_memory_reduction": 0.2},
        "quality": {"greedy_identity": 1.0, "needle_baseline": 1.0, "needle_accelerated": 0.8,
                    "perplexity_baseline": 10.0, "perplexity_accelerated": 10.5,
                    "multikey_baseline": 0.5, "multikey_accelerated": 0.5,
                    "top1_agreement": 0.9, "mean_abs_logprob_delta": 0.25},
    }
    text = report.table(result)
    assert "TTFT @ 512 tok" in text and "2.00x" in text and "+5.0%" in text
    assert "top-1 agreement with baseline" in text and "90.0%" in text
    report.write_json(result, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["ratios"]["ttft_speedup"] == 2.0
    pytest.importorskip("matplotlib")
    report.write_plot(result, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_runs_the_quick_base_bench(monkeypatch, tmp_path):
    """`make demo` = `vllm-accel demo`: the quick plan of the base feature, default model."""
    from vllm_accel.bench import harness

    seen = {}

    def fake_run_feature(feature, plan, model_dir, model_name, *args):
        seen.update(feature=feature.name, plan=plan, model=model_name)
        raise harness.BenchError("stop here")

    monkeypatch.setattr(cli, "_model_dir_and_name", lambda model: ("/m", model))
    monkeypatch.setattr(harness, "run_feature", fake_run_feature)
    assert cli.main(["demo", "--json", str(tmp_path / "d.json")]) == 1
    from vllm_accel.bench.features import FEATURES

    assert seen == {"feature": "base", "plan": FEATURES["base"].quick,
                    "model": FEATURES["base"].model}


def test_bench_dtype_sets_both_kv_quant_sides(capsys, bench_sides):
    assert cli.main(["bench", "speed", "--dtype", "float32"]) == 2
    assert "--dtype applies to the kv-quant bench only" in capsys.readouterr().err
    assert cli.main(["bench", "kv-quant", "--quick", "--dtype", "float32"]) == 1
    assert bench_sides["baseline"]["dtype"] == bench_sides["accelerated"]["dtype"] == "float32"
    assert bench_sides["accelerated"]["kv_cache_dtype"] == "kivi_4bit"


def test_bench_kv_quant_step_size_on_both_sides_and_prefill_kv_on_kivi(capsys, bench_sides):
    assert cli.main(["bench", "base", "--prefill-kv", "cache"]) == 2
    assert "--prefill-kv applies to the kv-quant bench only" in capsys.readouterr().err
    assert cli.main(["bench", "kv-quant", "--quick", "--max-num-batched-tokens", "8192",
                     "--prefill-kv", "cache"]) == 1
    assert (bench_sides["baseline"]["max_num_batched_tokens"]
            == bench_sides["accelerated"]["max_num_batched_tokens"] == 8192)
    assert bench_sides["accelerated"]["additional_config"] == {
        "vllm_accel": {"kv_quant": {"prefill_kv": "cache"}}}
    assert "additional_config" not in bench_sides["baseline"]
