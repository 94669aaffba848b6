"""The general plugin in a real vLLM install: registration, gates, spawn-safe enum members."""

from __future__ import annotations

import pickle
import subprocess
import sys

from vllm_accel import plugin


def _run(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_register_is_idempotent_and_registers_every_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_accel.attention.registry import BACKENDS
    from vllm_accel.patching import active_patches

    plugin.register()
    plugin.register()
    for name, info in BACKENDS.items():
        assert AttentionBackendEnum[name].get_path() == info.class_path
    names = [p.name for p in active_patches()]
    assert names.count("backend_enum_pickle") == 1
    assert "cpu_backend_selection" in names


def test_vllm_selects_registered_name_case_insensitively():
    from vllm.config.attention import AttentionConfig

    plugin.register()
    assert AttentionConfig.validate_backend_before("accel_base").name == "ACCEL_BASE"


def test_backend_member_unpickles_in_a_fresh_process():
    """A spawned worker unpickles the config before plugins load (the enum patch's reason)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    plugin.register()
    payload = pickle.dumps(AttentionBackendEnum["ACCEL_BASE"])
    code = (
        "import pickle, sys\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "assert 'ACCEL_BASE' not in E.__members__\n"
        f"m = pickle.loads({payload!r})\n"
        "print(m.name, m.get_path())\n"
    )
    result = _run(code, VLLM_PLUGINS="none")  # no plugin: only the pickle can register it
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ACCEL_BASE vllm_accel.attention.base.AccelBaseBackend" in result.stdout


def test_disable_env_turns_the_plugin_off():
    code = ("from vllm_accel import plugin; plugin.register();"
            "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E;"
            "print('ACCEL_BASE' in E.__members__, plugin.inactive_reason())")
    result = _run(code, VLLM_ACCEL_DISABLE="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False VLLM_ACCEL_DISABLE is set"


def test_unsupported_vllm_version_leaves_plugin_inert_with_a_clear_message():
    code = ("import vllm; vllm.__version__ = '0.99.0';"
            "from vllm_accel import plugin; plugin.register();"
            "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E;"
            "print('ACCEL_BASE' in E.__members__); print(plugin.inactive_reason())")
    result = _run(code)
    assert result.returncode == 0, result.stderr[-2000:]
    registered, message = result.stdout.strip().splitlines()[-2:]
    assert registered == "False"
    assert "supports vLLM 0.32.0, found vLLM 0.99.0" in message


def test_unsupported_version_message_is_none_for_the_supported_release():
    assert plugin.unsupported_version_message("0.32.0") is None


def test_a_patch_conflict_leaves_the_plugin_inert_instead_of_crashing_vllm():
    code = (
        "from vllm.platforms.cpu import CpuPlatform\n"
        "def other(cls, *a, **k): return 'other'\n"
        "other.__module__ = 'another_plugin'\n"
        "CpuPlatform.get_attn_backend_cls = classmethod(other)\n"
        "from vllm_accel import plugin; plugin.register()\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "print('ACCEL_BASE' in E.__members__); print(plugin.inactive_reason())\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr[-2000:]
    registered, message = result.stdout.strip().splitlines()[-2:]
    assert registered == "False"
    assert "inactive" in message and "another_plugin" in message
