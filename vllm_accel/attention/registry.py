"""The attention backends vllm_accel registers with vLLM, by ``--attention-backend`` name.

Names are upper case (vLLM upper-cases the flag value) and start with ``ACCEL_``. This table is
the single source of truth: the plugin registers it, the enum-pickling patch recognises it, the
CPU selector patch honours it, and ``vllm-accel doctor`` lists it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendInfo:
    name: str
    class_path: str
    summary: str
    #: The class on CUDA when it differs from ``class_path`` (the CPU one).
    cuda_class_path: str | None = None

    def class_path_for(self, platform_is_cpu: bool) -> str:
        return self.class_path if platform_is_cpu else self.cuda_class_path or self.class_path


BACKENDS: dict[str, BackendInfo] = {
    info.name: info
    for info in (
        BackendInfo(
            "ACCEL_BASE",
            "vllm_accel.attention.base.AccelBaseBackend",
            "dense attention delegated to the platform's own backend; the base of the feature "
            "backends (and a check that the plugin plumbing is transparent)",
        ),
        BackendInfo(
            "ACCEL_SPARSE_PREFILL",
            "vllm_accel.attention.sparse_prefill.backend.SparsePrefillBackend",
            "block-sparse attention for prefills above a length threshold, vLLM's dense CPU "
            "kernel for shorter prefills and decodes (CPU only; knobs: vllm_accel.sparse_prefill)",
        ),
        BackendInfo(
            "ACCEL_SPEED",
            "vllm_accel.speed.backend.SpeedBackend",
            "SPEED (shallow prefill, deep decode): prompt tokens run only the lower layers, the "
            "upper layers keep KV for an anchor and the decode tokens (CPU; CUDA: written, not "
            "yet run on a GPU; Llama/Qwen2; knobs: vllm_accel.speed)",
            cuda_class_path="vllm_accel.speed.backend_cuda.SpeedCudaBackend",
        ),
        BackendInfo(
            "ACCEL_KIVI_4BIT",
            "vllm_accel.kv_quant.backend.Kivi4BitBackend",
            "KIVI-style 4-bit KV cache (keys per channel, values per token); selected by "
            "--kv-cache-dtype kivi_4bit (CPU; CUDA: the Triton kernels, written, not yet run "
            "on a GPU)",
        ),
        BackendInfo(
            "ACCEL_KIVI_2BIT",
            "vllm_accel.kv_quant.backend.Kivi2BitBackend",
            "KIVI-style 2-bit KV cache (keys per channel, values per token); selected by "
            "--kv-cache-dtype kivi_2bit (CPU; CUDA: the Triton kernels, written, not yet run "
            "on a GPU)",
        ),
    )
}

# --kv-cache-dtype names vllm_accel adds to vLLM -> the backend that owns that page format.
# With one of these dtypes and no --attention-backend, that backend is selected; another
# explicit backend is an error (vllm_accel._patches.kv_cache_dtype_backend).
KV_CACHE_DTYPE_BACKENDS: dict[str, str] = {
    "kivi_4bit": "ACCEL_KIVI_4BIT",
    "kivi_2bit": "ACCEL_KIVI_2BIT",
}


def is_accel_backend_name(name: str) -> bool:
    return name.upper() in BACKENDS
