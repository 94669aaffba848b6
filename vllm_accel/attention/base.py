"""``ACCEL_BASE``: the attention backend every vllm_accel backend builds on.

It is the platform's own dense backend under a vllm_accel name:

* CPU  → vLLM's ``CPU_ATTN`` (``CPUAttentionBackend``: Backend, Builder and Impl unchanged);
* CUDA → vLLM's ``FLASH_ATTN`` where flash-attn imports, else ``TRITON_ATTN``.

On its own it changes nothing about the numbers (greedy output is token-identical to vLLM's
default backend; tests/integration checks that). Its job is to be the tested seam: feature
backends (``ACCEL_SPEED``, ``ACCEL_SPARSE_PREFILL``) subclass :func:`dense_backend_class`'s
result and override only the roles their feature changes (usually the Impl and the Builder),
so the dense path stays vLLM's own kernel on every platform.

Selection: ``--attention-backend ACCEL_BASE`` (``LLM(..., attention_backend="ACCEL_BASE")``).
"""

from __future__ import annotations

from functools import cache

from vllm.v1.attention.backend import AttentionBackend


@cache
def dense_backend_class() -> type[AttentionBackend]:
    """The platform's dense attention backend class that vllm_accel delegates to."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend
    if current_platform.is_cuda_alike():
        try:
            from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

            return FlashAttentionBackend
        except ImportError:
            from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

            return TritonAttentionBackend
    raise RuntimeError(
        f"vllm_accel attention backends support the CPU and CUDA platforms; this is "
        f"{type(current_platform).__name__}. Drop --attention-backend ACCEL_* on this platform."
    )


_Dense = dense_backend_class()


class AccelBaseBackend(_Dense):  # type: ignore[valid-type, misc]
    """Dense attention through the platform's backend, registered as ``ACCEL_BASE``."""

    @staticmethod
    def get_name() -> str:
        return "ACCEL_BASE"
