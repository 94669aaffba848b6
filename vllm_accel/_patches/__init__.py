"""The runtime patches vllm_accel applies, and where.

Each module defines one ``PATCH`` (a :class:`vllm_accel.patching.RuntimePatch`) and has an
upstream twin in the repository's ``patches/`` folder. Keep this list short: every entry is a
place where vLLM 0.32 has no extension point.
"""

from __future__ import annotations

from vllm_accel.patching import RuntimePatch, apply, apply_when_imported


def plugin_patches(platform_is_cpu: bool) -> list[RuntimePatch]:
    """Patches the general plugin applies in every vLLM process."""
    from vllm_accel._patches import (
        backend_enum_pickle,
        cpu_backend_selection,
        kv_cache_dtype_backend,
        kv_cache_dtype_names,
    )

    patches = [backend_enum_pickle.PATCH]
    if platform_is_cpu:
        patches.append(cpu_backend_selection.PATCH)
    # --kv-cache-dtype kivi_* (vllm_accel.kv_quant): the names, then their backend selection.
    patches += [*kv_cache_dtype_names.PATCHES, kv_cache_dtype_backend.PATCH]
    return patches


def frontend_patches() -> list[RuntimePatch]:
    """Patches of the request front end (API server, ``LLM``), applied by the plugin when
    ``vllm.v1.engine.input_processor`` is imported: other processes never load it, and importing
    it costs seconds."""
    from vllm_accel._patches import kv_transfer_params_validation

    return [kv_transfer_params_validation.PATCH]


def on_demand_patches() -> list[RuntimePatch]:
    """Patches applied by the feature that needs them, in the process that needs them.

    ``proposer_input_batch`` and ``proposer_target_logits`` target ``GPUModelRunner``, whose
    module takes ~8 s to import: applying them from the plugin would add that to every vLLM
    process (API server, engine front-end), so the proposers that need them apply them when
    the model runner builds them (``SAMProposer``: the input batch; ``RecyclingProposer``: the
    target's logits; ``HybridProposer``: both); ``attention_step_requests`` (every request's
    prompt length and id for attention builders) is applied by the SPEED model and the KIVI
    builder in the worker. Every
    proposer also applies ``cpu_rejection_expand`` (vLLM's CPU build verifies drafts with
    uninitialised temperature / top-k / top-p without it).
    """
    from vllm_accel._patches import (
        attention_step_requests,
        cpu_rejection_expand,
        proposer_input_batch,
        proposer_target_logits,
    )

    return [proposer_input_batch.PATCH, proposer_target_logits.PATCH,
            cpu_rejection_expand.PATCH, attention_step_requests.PATCH]


def all_patches() -> list[RuntimePatch]:
    """Every runtime patch shipped, including those applied only by the ``vllm-accel`` CLI."""
    from vllm_accel._patches import cli_version_lookup

    return [*plugin_patches(platform_is_cpu=True), *frontend_patches(), cli_version_lookup.PATCH,
            *on_demand_patches()]


def apply_plugin_patches(vllm_version: str, platform_is_cpu: bool) -> None:
    for patch in plugin_patches(platform_is_cpu):
        apply(patch, vllm_version)
    for patch in frontend_patches():
        apply_when_imported(patch, vllm_version)
