"""Environment defaults that make vLLM's CPU build use every core of the machine.

vLLM-CPU binds its worker to one core and reserves another by default; on a 2-core machine
that halves prefill speed. We set ``VLLM_CPU_OMP_THREADS_BIND`` to all cores and
``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` unless the user already set them.
"""

from __future__ import annotations

import os


def cpu_thread_env() -> dict[str, str]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{max((cores or 1) - 1, 0)}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def apply_cpu_thread_env() -> None:
    for key, value in cpu_thread_env().items():
        os.environ.setdefault(key, value)


def engine_env() -> dict[str, str]:
    """Environment for a child process that runs a vLLM engine.

    The current environment, plus the CPU thread defaults, minus ``TRITON_INTERPRET`` (the test
    suite sets it to run Triton kernels on the CPU; vLLM's engine must not see it).
    """
    env = {**cpu_thread_env(), **os.environ}
    env.pop("TRITON_INTERPRET", None)
    return env
