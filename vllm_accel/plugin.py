"""vLLM general-plugin entry point (``vllm.general_plugins`` → ``vllm_accel.plugin:register``).

vLLM calls :func:`register` once in every process it starts (API server, EngineCore, each
worker, the model-inspection subprocess), and in every vLLM run of an environment where
vllm_accel is installed, whether or not the run uses a vllm_accel feature. So it must be:

* idempotent — a second call in the same process does nothing;
* cheap — it registers names (backends, SPEED's model classes and KV-cache spec) and installs
  a few small patches; no model code, no kernels. Registering imports vLLM's model registry and
  KV-cache manager modules, which every engine process imports anyway;
* safe — on an unsupported vLLM version, or when a runtime patch cannot be applied (e.g.
  another plugin already replaced the same attribute), it logs one clear error and stays inert
  instead of breaking unrelated vLLM runs (vLLM does not catch exceptions raised here);
* switchable — ``VLLM_ACCEL_DISABLE=1`` turns it off entirely.
"""

from __future__ import annotations

import os

from vllm_accel import SUPPORTED_VLLM_VERSION
from vllm_accel.log import get_logger

logger = get_logger("plugin")

_state: dict[str, object] = {"registered": False, "inactive_reason": None}


def disabled_by_env() -> bool:
    return os.environ.get("VLLM_ACCEL_DISABLE", "").strip().lower() in ("1", "true", "yes")


def unsupported_version_message(found: str) -> str | None:
    if found == SUPPORTED_VLLM_VERSION:
        return None
    return (
        f"vllm_accel supports vLLM {SUPPORTED_VLLM_VERSION}, found vLLM {found}: vllm_accel is "
        f"inactive. Install the supported release (pip install 'vllm-accel[cpu]' or "
        f"'vllm-accel[cuda]') or a vllm_accel release built for vLLM {found}."
    )


def register() -> None:
    """Register vllm_accel's backends and runtime patches in this process."""
    if _state["registered"]:
        return
    _state["registered"] = True
    if disabled_by_env():
        _state["inactive_reason"] = "VLLM_ACCEL_DISABLE is set"
        logger.info("vllm_accel: disabled by VLLM_ACCEL_DISABLE")
        return

    import vllm

    message = unsupported_version_message(vllm.__version__)
    if message:
        _state["inactive_reason"] = message
        logger.error(message)
        return

    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from vllm_accel._patches import apply_plugin_patches
    from vllm_accel.attention.registry import BACKENDS
    from vllm_accel.patching import PatchError

    try:
        apply_plugin_patches(vllm.__version__, platform_is_cpu=current_platform.is_cpu())
    except PatchError as exc:
        # Without its patches the plugin cannot work, but it must not take down vLLM runs that
        # do not use it: register nothing, say why (ACCEL_* names are then unknown to vLLM).
        _state["inactive_reason"] = f"vllm_accel is inactive: {exc}"
        logger.error(_state["inactive_reason"])
        return
    for info in BACKENDS.values():
        if info.name not in AttentionBackendEnum.__members__:
            register_backend(info.name, info.class_path_for(current_platform.is_cpu()))
    from vllm_accel.speed import registration as speed_registration

    try:
        speed_registration.register()
    except Exception as exc:  # never take vLLM down for one feature: say why it is missing
        logger.error("vllm_accel: ACCEL_SPEED is unavailable in this process: cannot register "
                     "its model classes / KV-cache spec (%s: %s)", type(exc).__name__, exc)


def inactive_reason() -> str | None:
    """Why the plugin did nothing in this process (None when active or not yet registered)."""
    return _state["inactive_reason"]  # type: ignore[return-value]
