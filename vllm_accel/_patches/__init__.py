"""The runtime patches vllm_accel applies, and where.

Each module defines one ``PATCH`` (a :class:`vllm_accel.patching.RuntimePatch`) and has an
upstream twin in the repository's ``patches/`` folder. Keep this list short: every entry is a
place where vLLM 0.32 has no extension point.
"""

from __future__ import annotations

from vllm_accel.patching import RuntimePatch, apply


def plugin_patches(platform_is_cpu: bool) -> list[RuntimePatch]:
    """Patches the general plugin applies in every vLLM process."""
    from vllm_accel._patches import backend_enum_pickle, cpu_backend_selection

    patches = [backend_enum_pickle.PATCH]
    if platform_is_cpu:
        patches.append(cpu_backend_selection.PATCH)
    return patches


def all_patches() -> list[RuntimePatch]:
    """Every runtime patch shipped, including those applied only by the ``vllm-accel`` CLI."""
    from vllm_accel._patches import cli_version_lookup

    return plugin_patches(platform_is_cpu=True) + [cli_version_lookup.PATCH]


def apply_plugin_patches(vllm_version: str, platform_is_cpu: bool) -> None:
    for patch in plugin_patches(platform_is_cpu):
        apply(patch, vllm_version)
