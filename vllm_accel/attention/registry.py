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


BACKENDS: dict[str, BackendInfo] = {
    info.name: info
    for info in (
        BackendInfo(
            "ACCEL_BASE",
            "vllm_accel.attention.base.AccelBaseBackend",
            "dense attention delegated to the platform's own backend; the base of the feature "
            "backends (and a check that the plugin plumbing is transparent)",
        ),
    )
}


def is_accel_backend_name(name: str) -> bool:
    return name.upper() in BACKENDS
