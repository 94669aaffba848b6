"""Environment defaults that make vLLM's CPU build use every core of the machine.

vLLM-CPU binds its worker to one core and reserves another by default; on a 2-core machine
that halves prefill speed. We set ``VLLM_CPU_OMP_THREADS_BIND`` to all cores and
``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` unless the user already set them.
"""

from __future__ import annotations

import os


def _num_cores() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def core_ranges(ranks: int) -> str:
    """All cores split into ``ranks`` contiguous ranges, ``|``-separated: vLLM-CPU wants one
    entry per local rank (tensor parallelism) in ``VLLM_CPU_OMP_THREADS_BIND``."""
    cores = _num_cores()
    if ranks > cores:
        raise ValueError(f"--tensor-parallel-size {ranks} needs at least {ranks} CPU cores; "
                         f"this machine has {cores}")
    bounds = [round(i * cores / ranks) for i in range(ranks + 1)]
    return "|".join(f"{a}-{b - 1}" if b - 1 > a else str(a) for a, b in zip(bounds, bounds[1:]))


def cpu_thread_env() -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": core_ranges(1), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def apply_cpu_thread_env() -> None:
    for key, value in cpu_thread_env().items():
        os.environ.setdefault(key, value)


def engine_env(ranks: int = 1) -> dict[str, str]:
    """Environment for a child process that runs a vLLM engine with ``ranks`` local workers.

    The current environment, plus the CPU thread defaults, minus ``TRITON_INTERPRET`` (the test
    suite sets it to run Triton kernels on the CPU; vLLM's engine must not see it). A thread
    binding with another number of ranks than the engine has (vLLM-CPU refuses to start then)
    is replaced by the cores split evenly between the ranks.
    """
    env = {**cpu_thread_env(), **os.environ}
    env.pop("TRITON_INTERPRET", None)
    bind = env["VLLM_CPU_OMP_THREADS_BIND"]
    if bind not in ("auto", "nobind") and len(bind.split("|")) != ranks:
        env["VLLM_CPU_OMP_THREADS_BIND"] = core_ranges(ranks)
    return env
