"""--kv-cache-dtype kivi_4bit / kivi_2bit: accepted by vLLM's config, CLI and selector after the
plugin registers; unknown names keep vLLM's own errors; the backend follows the dtype."""

from __future__ import annotations

import typing

import pytest
import torch

from vllm_accel import plugin
from vllm_accel.attention.registry import KV_CACHE_DTYPE_BACKENDS


@pytest.fixture(scope="module", autouse=True)
def registered():
    plugin.register()


def test_patches_are_active_and_idempotent():
    import vllm

    from vllm_accel._patches import apply_plugin_patches, kv_cache_dtype_names
    from vllm_accel.patching import active_patches

    apply_plugin_patches(vllm.__version__, platform_is_cpu=True)  # again: no-op
    names = [p.name for p in active_patches()]
    for patch in [*kv_cache_dtype_names.PATCHES]:
        assert names.count(patch.name) == 1
    assert "kv_cache_dtype_backend" in names


def test_cache_config_accepts_the_new_names_only():
    import pydantic
    from vllm.config.cache import CacheConfig

    for name in KV_CACHE_DTYPE_BACKENDS:
        assert CacheConfig(cache_dtype=name).cache_dtype == name
    with pytest.raises(pydantic.ValidationError, match="cache_dtype"):
        CacheConfig(cache_dtype="kivi_3bit")


def test_cli_choices(capsys):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert parser.parse_args(["--kv-cache-dtype", "kivi_4bit"]).kv_cache_dtype == "kivi_4bit"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "kivi_3bit"])
    assert "invalid choice: 'kivi_3bit'" in capsys.readouterr().err


def test_selector_literal_and_storage_dtype():
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention import selector

    assert set(KV_CACHE_DTYPE_BACKENDS) <= set(typing.get_args(selector.CacheDType))
    assert kv_cache_dtype_str_to_dtype("kivi_2bit", None) is torch.uint8
    with pytest.raises(KeyError):
        kv_cache_dtype_str_to_dtype("kivi_3bit", None)


def test_dtype_selects_its_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_accel._patches.kv_cache_dtype_backend import resolve_backend_for_kv_dtype

    assert resolve_backend_for_kv_dtype(None, "kivi_4bit").name == "ACCEL_KIVI_4BIT"
    assert resolve_backend_for_kv_dtype(None, "kivi_2bit").name == "ACCEL_KIVI_2BIT"
    assert resolve_backend_for_kv_dtype(None, "auto") is None
    kivi4 = AttentionBackendEnum["ACCEL_KIVI_4BIT"]
    assert resolve_backend_for_kv_dtype(kivi4, "kivi_4bit") is kivi4
    with pytest.raises(ValueError, match=r"--kv-cache-dtype kivi_4bit.*--attention-backend "
                                         r"ACCEL_KIVI_4BIT.*got --attention-backend CPU_ATTN"):
        resolve_backend_for_kv_dtype(AttentionBackendEnum.CPU_ATTN, "kivi_4bit")
    with pytest.raises(ValueError, match=r"--attention-backend ACCEL_KIVI_4BIT.*"
                                         r"--kv-cache-dtype kivi_4bit"):
        resolve_backend_for_kv_dtype(kivi4, "auto")


def _selector_config(**overrides):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    base = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="kivi_4bit", block_size=128)
    base.update(overrides)
    return AttentionSelectorConfig(**base)


def test_startup_problems_name_the_flag_and_supported_values():
    from vllm_accel.kv_quant.backend import startup_problems

    assert startup_problems("kivi_4bit", _selector_config()) == []
    (block,) = startup_problems("kivi_4bit", _selector_config(block_size=32))
    assert "--block-size 32" in block and "multiples of 64" in block
    assert startup_problems("kivi_2bit", _selector_config(dtype=torch.float32)) == []
    (dtype,) = startup_problems("kivi_2bit", _selector_config(dtype=torch.float64))
    assert "--dtype float64" in dtype and "bfloat16, float16, float32" in dtype
    (head,) = startup_problems("kivi_4bit", _selector_config(head_size=12))
    assert "head size 12" in head
    (window,) = startup_problems("kivi_4bit", _selector_config(has_sliding_window=True))
    assert "sliding-window" in window


def test_startup_problems_check_the_format_knobs_against_the_model(monkeypatch):
    from vllm_accel.kv_quant.backend import startup_problems

    monkeypatch.setenv("VLLM_ACCEL_KV_QUANT_KEY_GROUP", "32")
    assert startup_problems("kivi_4bit", _selector_config(block_size=32)) == []
    monkeypatch.setenv("VLLM_ACCEL_KV_QUANT_KEY_GROUP", "128")
    (block,) = startup_problems("kivi_4bit", _selector_config(block_size=64))
    assert "key_group=128" in block and "multiples of 128" in block
    monkeypatch.setenv("VLLM_ACCEL_KV_QUANT_VALUE_GROUP", "24")
    (group,) = startup_problems("kivi_4bit", _selector_config())
    assert "value_group=24" in group and "head size 64" in group and "8, 16, 32, 64" in group
    assert startup_problems("kivi_4bit", _selector_config(head_size=96)) == []
    monkeypatch.delenv("VLLM_ACCEL_KV_QUANT_VALUE_GROUP")
    # the default value_rotation (auto) falls back to none where Hadamard cannot apply
    assert startup_problems("kivi_4bit", _selector_config(head_size=96)) == []
    monkeypatch.setenv("VLLM_ACCEL_KV_QUANT_VALUE_ROTATION", "hadamard")
    assert startup_problems("kivi_4bit", _selector_config(head_size=128)) == []
    (rotation,) = startup_problems("kivi_4bit", _selector_config(head_size=96))
    assert "value_rotation='hadamard'" in rotation and "head size" in rotation and "96" in rotation
    assert "'none' or 'auto'" in rotation  # the values that do run here
