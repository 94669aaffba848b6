"""Optional Triton: import it if present, and say when a Triton kernel can run.

The kernels in this package work without Triton (they fall back to their torch paths). Triton
kernels run on CUDA tensors, or on CPU tensors when the interpreter is on (``TRITON_INTERPRET=1``,
which must be set before ``triton`` is first imported; the unit tests do that in their conftest).
"""

from __future__ import annotations

import os

import torch

try:  # pragma: no cover - exercised by which packages are installed
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install
    triton = None
    tl = None
    HAS_TRITON = False


def triton_interpreter_enabled() -> bool:
    """True when Triton kernels run in the (slow, CPU) interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_can_run_on(tensor: torch.Tensor) -> bool:
    """True when a Triton kernel can be launched on ``tensor``'s device."""
    if not HAS_TRITON:
        return False
    return tensor.is_cuda or (tensor.device.type == "cpu" and triton_interpreter_enabled())


def choose_backend(backend: str, tensor: torch.Tensor,
                   choices: tuple[str, ...] = ("torch", "triton")) -> str:
    """The implementation a kernel entry point runs: ``auto`` -> ``triton`` on CUDA (when
    Triton imports), else ``torch``; any other name must be one of ``choices``, and ``triton``
    needs a device Triton can run on (:func:`triton_can_run_on`)."""
    if backend == "auto":
        return "triton" if (tensor.is_cuda and triton_can_run_on(tensor)) else "torch"
    if backend not in choices:
        raise ValueError(f"unknown backend {backend!r}; choose auto, {', '.join(choices)}")
    if backend == "triton" and not triton_can_run_on(tensor):
        raise RuntimeError("Triton cannot run here (no triton, or CPU without TRITON_INTERPRET=1)")
    return backend


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
