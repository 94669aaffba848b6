"""The --additional-config vllm_accel section: typing, validation, env overrides, errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vllm_accel import config
from vllm_accel.config import AccelConfigError, load_section, register_section


@register_section("demo_feature")
@dataclass(frozen=True)
class DemoKnobs:
    tau: float = 0.9
    block: int = 64
    dense_layers: tuple[int, ...] = (0,)
    enabled: bool = True
    method: str = "xattn"

    def validate(self) -> dict[str, str]:
        problems = {}
        if not 0 < self.tau <= 1:
            problems["tau"] = "must be in (0, 1]"
        if self.method not in ("xattn", "mean"):
            problems["method"] = "choose one of xattn, mean"
        return problems


def test_defaults_when_nothing_is_set():
    assert load_section("demo_feature", None, environ={}) == DemoKnobs()


def test_values_are_typed_and_env_wins():
    cfg = load_section(
        "demo_feature",
        {"vllm_accel": {"demo_feature": {"tau": 0.5, "dense_layers": [0, 1], "block": 128}}},
        environ={"VLLM_ACCEL_DEMO_FEATURE_TAU": "0.25", "VLLM_ACCEL_DEMO_FEATURE_ENABLED": "0"},
    )
    assert cfg == DemoKnobs(tau=0.25, block=128, dense_layers=(0, 1), enabled=False)


@pytest.mark.parametrize("raw, message", [
    ({"tau": 1.5}, r"vllm_accel\.demo_feature\.tau=1\.5: must be in \(0, 1\]"),
    ({"method": "magic"}, r"demo_feature\.method='magic': choose one of xattn, mean"),
    ({"block": "big"}, r"demo_feature\.block='big': expected int"),
    ({"blokc": 3}, r"unknown key\(s\) \['blokc'\]"),
])
def test_bad_values_name_the_knob(raw, message):
    with pytest.raises(AccelConfigError, match=message):
        load_section("demo_feature", {"vllm_accel": {"demo_feature": raw}}, environ={})


def test_unknown_section_is_an_error():
    with pytest.raises(AccelConfigError, match=r"unknown section\(s\) \['nope'\]"):
        load_section("demo_feature", {"vllm_accel": {"nope": {}}}, environ={})
    assert "demo_feature" in config.sections()


def test_every_section_module_declares_its_section():
    known = config.sections()
    assert set(config.SECTION_MODULES) <= set(known)
    for name, module in config.SECTION_MODULES.items():
        assert known[name].__module__ == module


def test_a_process_that_loaded_one_feature_accepts_the_others_sections():
    """A proposer's worker imports only the spec_decode knobs; the engine's additional config
    also carries sparse_prefill (ACCEL_SPARSE_PREFILL + a proposer)."""
    import subprocess
    import sys

    code = ("import sys; from vllm_accel.config import load_section; "
            "import vllm_accel.kv_quant.config; "
            "assert 'vllm_accel.attention.sparse_prefill.config' not in sys.modules; "
            "load_section('kv_quant', {'vllm_accel': {'kv_quant': {}, "
            "'sparse_prefill': {'threshold': 256}}}, environ={}); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]
