"""What vllm_accel's CPU feature backends share: the refusals and the start-up checks.

``ACCEL_SPARSE_PREFILL`` and ``ACCEL_SPEED`` subclass vLLM's CPU backend (``cpu_attn.py``) and
change the Builder and the Impl; both run causal decoder self-attention over KV in the model's
dtype, on vLLM's CPU platform only. :class:`CpuFeatureBackend` states that once (vLLM reads
these through ``validate_configuration``, which the CPU selection patch and the CUDA platform
call at start-up); :func:`refuse_unsupported_attention` is the Impl-side check of the layer's
own attention features.
"""

from __future__ import annotations

from typing import ClassVar

from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend


class CausalDecoderOnly:
    """What vllm_accel's feature kernels attend: causal decoder self-attention, no sliding
    window (a mixin before the platform's backend class, CPU or CUDA)."""

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


class CpuFeatureBackend(CausalDecoderOnly, CPUAttentionBackend):
    """Causal decoder self-attention, no sliding window, KV in the model dtype, CPU only."""

    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        from vllm.platforms import current_platform

        reasons = list(super().validate_configuration(*args, **kwargs))
        if not current_platform.is_cpu():
            name = cls.get_name()
            reasons.append(
                f"{name} is wired for vLLM's CPU platform only in this release (its CUDA path "
                f"is not written yet); drop --attention-backend {name} (or use ACCEL_BASE) on "
                f"{type(current_platform).__name__}")
        return reasons


def refuse_unsupported_attention(impl, backend_name: str, what_for: str) -> None:
    """Raise at start-up if the layer's attention uses a feature the backend's kernel lacks."""
    # CPU impls say "no window" with -1, vLLM's CUDA impls with (-1, -1)
    window = getattr(impl, "sliding_window", None)
    fp8 = getattr(impl, "is_fp8_kv_cache", None)
    if fp8 is None:
        fp8 = str(getattr(impl, "kv_cache_dtype", "auto")).startswith("fp8")
    unsupported = [what for what, present in (
        ("ALiBi", impl.alibi_slopes is not None),
        ("a sliding window", window not in (None, -1, (-1, -1))),
        ("logits soft-capping", bool(impl.logits_soft_cap)),
        ("attention sinks", getattr(impl, "sinks", None) is not None),
        ("an fp8 KV cache", fp8),
        (f"attention type {impl.attn_type}", impl.attn_type != AttentionType.DECODER),
    ) if present]
    if unsupported:
        raise ValueError(
            f"--attention-backend {backend_name}: this model's attention uses "
            f"{', '.join(unsupported)}, which {what_for} does not implement. Use "
            f"--attention-backend ACCEL_BASE (or no flag) for this model.")
