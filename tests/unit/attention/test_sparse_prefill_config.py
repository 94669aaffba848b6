"""The sparse_prefill knobs: defaults, typing, env overrides, and errors that name the knob."""

from __future__ import annotations

import pytest

from vllm_accel.attention.sparse_prefill.config import (
    DEFAULT_THRESHOLD,
    SparsePrefillConfig,
    parse_layer_budgets,
)
from vllm_accel.config import AccelConfigError, load_section


def _load(raw=None, environ=None):
    extra = None if raw is None else {"vllm_accel": {"sparse_prefill": raw}}
    return load_section("sparse_prefill", extra, environ=environ or {})


def test_defaults():
    cfg = _load()
    assert cfg == SparsePrefillConfig()
    assert cfg.threshold == DEFAULT_THRESHOLD
    assert cfg.method == "antidiagonal" and cfg.tau == 0.9
    assert cfg.validate() == {}


def test_json_and_env_values_are_typed():
    cfg = _load({"tau": None, "density": 0.2, "dense_layers": [0, 1], "threshold": 8192},
                environ={"VLLM_ACCEL_SPARSE_PREFILL_MAX_BLOCKS": "12",
                         "VLLM_ACCEL_SPARSE_PREFILL_LAYER_BUDGETS": '{"3": {"tau": 0.95}}'})
    assert cfg.tau is None and cfg.density == 0.2 and cfg.max_blocks == 12
    assert cfg.dense_layers == (0, 1) and cfg.threshold == 8192
    assert cfg.budget_for_layer(3) == {"tau": 0.95, "density": 0.2, "max_blocks": 12}
    assert cfg.budget_for_layer(4) == {"tau": None, "density": 0.2, "max_blocks": 12}
    assert cfg.is_dense_layer(1) and not cfg.is_dense_layer(2)


@pytest.mark.parametrize("raw, message", [
    ({"tau": 1.5}, r"sparse_prefill\.tau=1\.5: must be in \(0, 1\]"),
    ({"tau": 0}, r"sparse_prefill\.tau=0\.0: must be in \(0, 1\]"),
    ({"density": -0.1}, r"sparse_prefill\.density=-0\.1: must be in \(0, 1\]"),
    ({"max_blocks": 0}, r"sparse_prefill\.max_blocks=0: must be >= 1"),
    ({"method": "magic"}, r"sparse_prefill\.method='magic': choose one of antidiagonal"),
    ({"threshold": 0}, r"sparse_prefill\.threshold=0: must be >= 1"),
    ({"threshold": "long"}, r"sparse_prefill\.threshold='long': expected int"),
    ({"query_block_size": 96}, r"sparse_prefill\.query_block_size=96: must be a multiple of "
                               r"key_block_size \(64\)"),
    ({"key_block_size": 40}, r"sparse_prefill\.key_block_size=40: must be >= 16 and a "
                             r"multiple of stride \(16\)"),
    ({"gqa": "none"}, r"sparse_prefill\.gqa='none': choose one of"),
    ({"dense_layers": [-1]}, r"sparse_prefill\.dense_layers=\(-1,\): layer indices"),
    ({"layer_budgets": {"x": {"tau": 0.5}}}, r"sparse_prefill\.layer_budgets=.*layer key 'x'"),
    ({"layer_budgets": {"2": {"topk": 3}}}, r"layer_budgets=.*unknown budget\(s\) \['topk'\]"),
    ({"layer_budgets": {"2": {"tau": [0.9, 2]}}}, r"layer_budgets=.*tau=2: must be in"),
    ({"layer_budgets": {"5-2": {"tau": 0.9}}}, r"layer_budgets=.*first <= last"),
    ({"tua": 0.9}, r"unknown key\(s\) \['tua'\]"),
])
def test_bad_values_name_the_knob(raw, message):
    with pytest.raises(AccelConfigError, match=message):
        _load(raw)


def test_bad_env_json_names_the_knob():
    with pytest.raises(AccelConfigError, match=r"layer_budgets=.*not valid JSON"):
        _load(environ={"VLLM_ACCEL_SPARSE_PREFILL_LAYER_BUDGETS": "{3: tau}"})


def test_layer_budget_ranges_and_per_head_lists():
    parsed = parse_layer_budgets({"0-2": {"tau": 0.95}, "7": {"density": [0.3, None]}})
    assert parsed == [((0, 2), {"tau": 0.95}), ((7, 7), {"density": (0.3, None)})]
    cfg = SparsePrefillConfig(layer_budgets={"0-2": {"tau": 0.95}, "7": {"density": [0.3, 0.1]}})
    assert cfg.budget_for_layer(1)["tau"] == 0.95
    assert cfg.budget_for_layer(7)["density"] == (0.3, 0.1)
    assert cfg.budget_for_layer(None) == {"tau": 0.9, "density": None, "max_blocks": None}


def test_model_checks_name_the_knob():
    SparsePrefillConfig(dense_layers=(0, 3)).check_model(num_layers=4, num_kv_heads=2)
    with pytest.raises(AccelConfigError, match=r"dense_layers=\[0, 4\]: layers \[4\] do not "
                                               r"exist \(the model has 4 layers"):
        SparsePrefillConfig(dense_layers=(0, 4)).check_model(num_layers=4, num_kv_heads=2)
    with pytest.raises(AccelConfigError, match=r"layer_budgets: layer 9 does not exist"):
        SparsePrefillConfig(layer_budgets={"2-9": {"tau": 0.5}}).check_model(4, 2)
    with pytest.raises(AccelConfigError, match=r"tau has 3 entries; the model has 2 KV heads"):
        SparsePrefillConfig(layer_budgets={"1": {"tau": [0.5, 0.6, 0.7]}}).check_model(4, 2)
