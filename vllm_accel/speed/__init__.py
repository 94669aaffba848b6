"""SPEED: shallow prefill, deep decode (``--attention-backend ACCEL_SPEED``).

* :mod:`vllm_accel.speed.config` -- the ``speed`` knobs (cut, anchor size).
* :mod:`vllm_accel.speed.reference` -- the PyTorch/transformers oracle of the policy.
* :mod:`vllm_accel.speed.kv_spec` -- the upper-layer KV-cache spec and its block manager.

Submodules are imported on demand: ``reference`` needs transformers, ``kv_spec`` needs vLLM.
"""

from vllm_accel.speed.config import SpeedConfig

__all__ = ["SpeedConfig"]
