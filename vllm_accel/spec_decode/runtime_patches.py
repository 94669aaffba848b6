"""Apply, from inside a proposer, the runtime patches it needs (model-runner process only).

The proposers are built by vLLM's model runner, in the worker process: that is where their
patches belong (``vllm_accel._patches.on_demand_patches`` says why they are not applied by the
plugin). Every proposer also applies ``cpu_rejection_expand``: without it, vLLM 0.32's CPU
build verifies drafts with uninitialised temperature / top-k / top-p under random sampling.
"""

from __future__ import annotations

from vllm_accel.log import get_logger

logger = get_logger("spec_decode")


def apply_patch(name: str, who: str, consequence: str) -> bool:
    """Apply ``vllm_accel._patches.<name>.PATCH``; log ``consequence`` and return False if it
    cannot be applied (a conflicting plugin, an unsupported vLLM)."""
    try:
        import importlib

        import vllm

        from vllm_accel.patching import apply

        patch = importlib.import_module(f"vllm_accel._patches.{name}").PATCH
        apply(patch, vllm.__version__)
        return True
    except Exception as exc:
        logger.error("%s: runtime patch %s not applied (%s); %s", who, name, exc, consequence)
        return False


def apply_sampling_fix(who: str) -> bool:
    return apply_patch("cpu_rejection_expand", who,
                       "on vLLM's CPU build, random sampling with speculative decoding may not "
                       "keep the output distribution")
