"""Knobs of the quantized KV cache (section ``kv_quant`` of ``--additional-config``).

The format itself is chosen with ``--kv-cache-dtype`` (``kivi_4bit`` / ``kivi_2bit``); these knobs
only say how it runs::

    --additional-config '{"vllm_accel": {"kv_quant": {"kernel": "torch"}}}'
    VLLM_ACCEL_KV_QUANT_KERNEL=torch

``residual`` records where the full-precision keys of each sequence's unfinished key group live.
Only ``"page"`` is wired: every page carries a residual area (self-contained, no per-request
state), which costs ``2 * key_group * head_size / block_size`` bytes per token and head (64 B at
D=64, N=128: kivi_4bit stores 136 B instead of bf16's 256 B per token and head, 1.88x; kivi_2bit
104 B, 2.46x). ``"tail"`` (residual in a per-request pool, 3.5x+ / 6x+) needs a stable
per-request slot that vLLM 0.32 does not give attention metadata builders; it is rejected with
that reason rather than silently replaced.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_accel.config import register_section

SECTION = "kv_quant"
KERNELS = ("auto", "torch", "triton")
RESIDUALS = ("page",)


@register_section(SECTION)
@dataclass(frozen=True)
class KvQuantKnobs:
    """``kernel``: implementation of the quantize-on-write and attention kernels (``auto``:
    Triton on CUDA, torch on CPU; ``triton`` on CPU needs ``TRITON_INTERPRET=1``).
    ``residual``: where the unfinished key group is kept (only ``page``; see the module doc)."""

    kernel: str = "auto"
    residual: str = "page"

    def validate(self) -> dict[str, str]:
        problems: dict[str, str] = {}
        if self.kernel not in KERNELS:
            problems["kernel"] = f"must be one of {', '.join(KERNELS)}"
        if self.residual == "tail":
            problems["residual"] = (
                "'tail' (residual keys in a per-request pool) is not wired yet: vLLM 0.32 gives "
                "attention builders no stable per-request slot; supported: page")
        elif self.residual not in RESIDUALS:
            problems["residual"] = f"must be one of {', '.join(RESIDUALS)}"
        return problems


def load_knobs(additional_config: dict | None) -> KvQuantKnobs:
    from vllm_accel.config import load_section

    return load_section(SECTION, additional_config)
