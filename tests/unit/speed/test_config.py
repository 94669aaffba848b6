"""The speed knobs: defaults, int-vs-float cut, env overrides, errors naming the knob."""

from __future__ import annotations

import pytest

from vllm_accel.config import AccelConfigError, load_section
from vllm_accel.speed.config import DEFAULT_CUT, SpeedConfig


def _load(raw=None, environ=None):
    extra = None if raw is None else {"vllm_accel": {"speed": raw}}
    return load_section("speed", extra, environ=environ or {})


def test_defaults():
    cfg = _load()
    assert cfg == SpeedConfig()
    assert cfg.cut == DEFAULT_CUT == 0.75 and cfg.anchor_tokens == 1
    assert cfg.validate() == {}


@pytest.mark.parametrize("cut, num_layers, expected", [
    (0.75, 24, 18),     # Qwen2.5-0.5B: the paper's default
    (0.875, 24, 21),
    (0.75, 30, 23),     # 22.5 rounds half up
    (0.75, 4, 3),
    (0.5, 4, 2),
    (0.01, 24, 1),      # at least one layer
    (1.0, 24, 24),      # fraction 1.0: every layer, dense
    (1, 24, 1),         # integer 1: layer index, one lower layer
    (18, 24, 18),
    (24, 24, 24),
])
def test_num_lower_layers(cut, num_layers, expected):
    cfg = SpeedConfig(cut=cut)
    assert cfg.validate() == {}
    assert cfg.num_lower_layers(num_layers) == expected
    assert cfg.is_dense(num_layers) == (expected == num_layers)


def test_json_int_and_float_cut_differ():
    assert _load({"cut": 1}).num_lower_layers(24) == 1
    assert _load({"cut": 1.0}).num_lower_layers(24) == 24


def test_env_overrides_json_and_keeps_the_type():
    cfg = _load({"cut": 0.5}, environ={"VLLM_ACCEL_SPEED_CUT": "18",
                                       "VLLM_ACCEL_SPEED_ANCHOR_TOKENS": "4"})
    assert cfg.cut == 18 and isinstance(cfg.cut, int) and cfg.anchor_tokens == 4
    cfg = _load(environ={"VLLM_ACCEL_SPEED_CUT": "0.625"})
    assert cfg.cut == 0.625 and cfg.num_lower_layers(24) == 15


@pytest.mark.parametrize("raw, message", [
    ({"cut": 0.0}, r"speed\.cut=0\.0: a fraction must be in \(0, 1\]"),
    ({"cut": 1.5}, r"speed\.cut=1\.5: a fraction must be in \(0, 1\]"),
    ({"cut": -0.25}, r"speed\.cut=-0\.25: a fraction must be in"),
    ({"cut": float("nan")}, r"speed\.cut=nan: a fraction must be in"),
    ({"cut": 0}, r"speed\.cut=0: a layer index must be >= 1"),
    ({"cut": -3}, r"speed\.cut=-3: a layer index must be >= 1"),
    ({"cut": "deep"}, r"speed\.cut='deep': expected a fraction"),
    ({"cut": True}, r"speed\.cut=True: expected a fraction"),
    ({"cut": None}, r"speed\.cut=None: expected a fraction"),
    ({"anchor_tokens": 0}, r"speed\.anchor_tokens=0: must be an integer in 1\.\.16"),
    ({"anchor_tokens": 17}, r"speed\.anchor_tokens=17: must be an integer in 1\.\.16"),
    ({"anchor_tokens": 2.5}, r"speed\.anchor_tokens=2\.5: must be an integer"),
    ({"anchor_tokens": "many"}, r"speed\.anchor_tokens='many': must be an integer"),
    ({"layers": 3}, r"speed: unknown key\(s\) \['layers'\]"),
])
def test_bad_values_name_the_knob(raw, message):
    with pytest.raises(AccelConfigError, match=message):
        _load(raw)


def test_bad_env_value_names_the_knob():
    with pytest.raises(AccelConfigError, match=r"speed\.cut='3/4': expected a fraction"):
        _load(environ={"VLLM_ACCEL_SPEED_CUT": "3/4"})


@pytest.mark.parametrize("cut", [25, 100])
def test_index_beyond_the_model_names_the_knob(cut):
    cfg = _load({"cut": cut})  # valid without a model ...
    with pytest.raises(AccelConfigError, match=rf"speed\.cut={cut}: layer index out of range "
                                               r"\(the model has 24 layers; allowed 1\.\.24\)"):
        cfg.num_lower_layers(24)  # ... but not for a 24-layer one


def test_num_lower_layers_rejects_invalid_cut_without_load_section():
    with pytest.raises(AccelConfigError, match=r"speed\.cut=2\.0"):
        SpeedConfig(cut=2.0).num_lower_layers(24)
