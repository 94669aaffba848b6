"""The runtime-patch helper: version gate, idempotence, conflicts, records."""

from __future__ import annotations

import sys
import types

import pytest

from vllm_accel import patching
from vllm_accel.patching import PatchError, RuntimePatch, apply


@pytest.fixture
def target_module(monkeypatch):
    module = types.ModuleType("fake_vllm_target")

    class Platform:
        @classmethod
        def select(cls, name):
            return f"original:{name}"

    Platform.__module__ = module.__name__
    Platform.select.__func__.__module__ = module.__name__
    module.Platform = Platform
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(patching, "_ACTIVE", {})
    return module


def _patch(name="wrap_select", versions=("1.0",)):
    def make(original):
        func = original.__func__

        def select(cls, name):
            return "patched:" + func(cls, name)

        return classmethod(select)

    return RuntimePatch(name=name, target="fake_vllm_target:Platform.select",
                        vllm_versions=versions, upstream_diff="0000-x.patch", reason="test",
                        make_replacement=make)


def test_applies_and_keeps_classmethod(target_module):
    assert apply(_patch(), "1.0") is True
    assert target_module.Platform.select("a") == "patched:original:a"
    assert [p.name for p in patching.active_patches()] == ["wrap_select"]


def test_second_apply_is_a_noop(target_module):
    apply(_patch(), "1.0")
    assert apply(_patch(), "1.0") is False
    assert target_module.Platform.select("a") == "patched:original:a"  # not wrapped twice


def test_version_gate_names_versions(target_module):
    with pytest.raises(PatchError, match=r"written for vLLM 1\.0; found vLLM 2\.0"):
        apply(_patch(), "2.0")
    assert target_module.Platform.select("a") == "original:a"


def test_two_patches_cannot_own_one_attribute(target_module):
    apply(_patch("first"), "1.0")
    with pytest.raises(PatchError, match="already replaced by vllm_accel patch 'first'"):
        apply(_patch("second"), "1.0")


def test_refuses_to_stack_on_a_foreign_patch(target_module):
    def foreign(cls, name):
        return "other plugin"

    foreign.__module__ = "other_plugin.patches"
    target_module.Platform.select = classmethod(foreign)
    with pytest.raises(PatchError, match="other_plugin.patches"):
        apply(_patch(), "1.0")


@pytest.fixture
def deferred_module(tmp_path, monkeypatch):
    """A module file not imported yet, and a patch of it; the helper's state restored after."""
    (tmp_path / "fake_deferred_target.py").write_text(
        "class Thing:\n    def run(self):\n        return 'original'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(patching, "_ACTIVE", {})
    monkeypatch.setattr(patching, "_DEFERRED", {})
    yield RuntimePatch(name="wrap_run", target="fake_deferred_target:Thing.run",
                       vllm_versions=("1.0",), upstream_diff="0000-x.patch", reason="test",
                       make_replacement=lambda original: lambda self: "patched:" + original(self))
    sys.modules.pop("fake_deferred_target", None)
    if patching._FINDER in sys.meta_path:
        sys.meta_path.remove(patching._FINDER)


def test_apply_when_imported_waits_for_the_module(deferred_module):
    patching.apply_when_imported(deferred_module, "1.0")
    assert "fake_deferred_target" not in sys.modules  # nothing imported on its behalf
    assert patching.active_patches() == []
    import fake_deferred_target

    assert fake_deferred_target.Thing().run() == "patched:original"
    assert [p.name for p in patching.active_patches()] == ["wrap_run"]


def test_apply_when_imported_applies_at_once_to_a_loaded_module(deferred_module):
    import fake_deferred_target

    patching.apply_when_imported(deferred_module, "1.0")
    assert fake_deferred_target.Thing().run() == "patched:original"


def test_apply_when_imported_checks_the_version_first(deferred_module):
    with pytest.raises(PatchError, match="found vLLM 2.0"):
        patching.apply_when_imported(deferred_module, "2.0")
    assert patching._DEFERRED == {}
