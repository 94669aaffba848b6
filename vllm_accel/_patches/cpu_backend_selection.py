"""Let the CPU platform honour ``--attention-backend ACCEL_*``.

``CpuPlatform.get_attn_backend_cls`` (vllm/platforms/cpu.py:143-179 in 0.32.0) always returns
``CPU_ATTN`` and only logs "Cannot use ... backend on CPU" for any other selection. The patch
honours our registered names, after the same ``validate_configuration`` check the CUDA
platform performs (an invalid configuration raises instead of falling back silently), and
leaves every other selection to the original. Upstream twin:
``patches/0002-cpu-platform-honour-registered-backends.patch``.
"""

from __future__ import annotations

from typing import Any

from vllm_accel.attention.registry import BACKENDS
from vllm_accel.log import get_logger
from vllm_accel.patching import RuntimePatch

logger = get_logger("attention")


def _make_replacement(original: Any) -> Any:
    original_func = original.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend is None or selected_backend.name not in BACKENDS:
            return original_func(cls, selected_backend, attn_selector_config, num_heads)
        backend_class = selected_backend.get_class()
        invalid_reasons = backend_class.validate_configuration(
            device_capability=cls.get_device_capability(), **attn_selector_config._asdict()
        )
        if invalid_reasons:
            raise ValueError(
                f"--attention-backend {selected_backend.name} cannot run this model on CPU: "
                f"{'; '.join(invalid_reasons)}. Run `vllm-accel doctor` for what each backend "
                f"supports, or drop the flag to use vLLM's CPU_ATTN."
            )
        logger.info("Using %s backend on CPU.", selected_backend.name)
        return selected_backend.get_path()

    return classmethod(get_attn_backend_cls)


PATCH = RuntimePatch(
    name="cpu_backend_selection",
    target="vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls",
    vllm_versions=("0.32.0",),
    upstream_diff="0002-cpu-platform-honour-registered-backends.patch",
    reason="the CPU platform ignores --attention-backend for registered backends",
    make_replacement=_make_replacement,
)
