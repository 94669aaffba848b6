"""Knobs of the quantized KV cache: defaults, validation messages, environment override."""

from __future__ import annotations

import doctest

import pytest

from vllm_accel.config import AccelConfigError
from vllm_accel.kv_quant.config import KvQuantKnobs, load_knobs, resolve_prefill_kv


def test_defaults():
    knobs = load_knobs(None)
    assert knobs == KvQuantKnobs(kernel="auto", residual="tail", prefill_kv="auto", key_group=64,
                                 value_group=0, sink_tokens=0)


def test_json_and_env(monkeypatch):
    assert load_knobs({"vllm_accel": {"kv_quant": {"kernel": "torch"}}}).kernel == "torch"
    monkeypatch.setenv("VLLM_ACCEL_KV_QUANT_KERNEL", "triton")
    assert load_knobs({"vllm_accel": {"kv_quant": {"kernel": "torch"}}}).kernel == "triton"


def test_bad_kernel_names_the_knob():
    with pytest.raises(AccelConfigError, match=r"vllm_accel\.kv_quant\.kernel='cuda'.*auto"):
        load_knobs({"vllm_accel": {"kv_quant": {"kernel": "cuda"}}})


def test_residual_modes():
    assert load_knobs({"vllm_accel": {"kv_quant": {"residual": "page"}}}).residual == "page"
    with pytest.raises(AccelConfigError, match=r"kv_quant\.residual='sink'.*tail, page"):
        load_knobs({"vllm_accel": {"kv_quant": {"residual": "sink"}}})


def test_unknown_key_is_refused():
    with pytest.raises(AccelConfigError, match=r"unknown key.*bits"):
        load_knobs({"vllm_accel": {"kv_quant": {"bits": 3}}})


def test_prefill_kv_modes():
    assert load_knobs({"vllm_accel": {"kv_quant": {"prefill_kv": "cache"}}}).prefill_kv == "cache"
    with pytest.raises(AccelConfigError, match=r"kv_quant\.prefill_kv='fp16'.*auto, exact, cache"):
        load_knobs({"vllm_accel": {"kv_quant": {"prefill_kv": "fp16"}}})
    assert resolve_prefill_kv("auto", "native") == "exact"
    assert resolve_prefill_kv("auto", "torch") == "exact"
    assert resolve_prefill_kv("auto", "triton") == "cache"
    assert resolve_prefill_kv("cache", "native") == "cache"


def test_format_knobs_are_validated_at_load():
    knobs = load_knobs({"vllm_accel": {"kv_quant": {"key_group": 32, "value_group": 16,
                                                    "sink_tokens": 4}}})
    assert (knobs.key_group, knobs.value_group, knobs.sink_tokens) == (32, 16, 4)
    for key, value, allowed in (("key_group", 48, r"16, 32, 64, 128"),
                                ("value_group", 12, r"multiple of 8"),
                                ("sink_tokens", 64, r"\[0, 32\]"),
                                ("sink_tokens", -1, r"\[0, 32\]")):
        with pytest.raises(AccelConfigError, match=rf"kv_quant\.{key}={value}.*{allowed}"):
            load_knobs({"vllm_accel": {"kv_quant": {key: value}}})
    assert load_knobs({"vllm_accel": {"kv_quant": {"value_rotation": "hadamard"}}}
                      ).value_rotation == "hadamard"
    with pytest.raises(AccelConfigError, match=r"value_rotation=.?random.*auto, none, hadamard"):
        load_knobs({"vllm_accel": {"kv_quant": {"value_rotation": "random"}}})
    with pytest.raises(AccelConfigError, match=r"sink_tokens=16.*\[0, 15\]"):
        load_knobs({"vllm_accel": {"kv_quant": {"key_group": 16, "sink_tokens": 16}}})


def test_value_rotation_auto_rotates_where_the_head_size_allows_it():
    """The default ``auto`` stores values Hadamard-rotated at power-of-two head sizes and as
    they are elsewhere (a model with head size 96 must still start with the defaults)."""
    from vllm_accel.kv_quant import config
    from vllm_accel.kv_quant.backend import page_layout

    assert KvQuantKnobs().value_rotation == "auto"
    assert [config.resolve_value_rotation("auto", d) for d in (32, 64, 80, 96, 128)] == [
        "hadamard", "hadamard", "none", "none", "hadamard"]
    assert config.resolve_value_rotation("none", 64) == "none"
    assert config.resolve_value_rotation("hadamard", 128) == "hadamard"
    assert page_layout("kivi_4bit", 64, 128).value_rotation == "hadamard"
    assert page_layout("kivi_4bit", 96, 128).value_rotation == "none"
    assert page_layout("kivi_4bit", 64, 128, knobs=KvQuantKnobs(value_rotation="none")
                       ).value_rotation == "none"
    assert doctest.testmod(config).failed == 0
