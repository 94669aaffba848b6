"""The ``sparse-prefill`` benchmark's sides, and how its attention time and density are read.

``vllm-accel bench sparse-prefill [--quick]`` (definition: ``features.FEATURES``) runs, in one
invocation, one engine per side with the same engine settings and the same prompts:

* ``baseline``: ``ACCEL_SPARSE_PREFILL`` with ``method=dense``: every request of every layer
  goes through vLLM's own CPU attention kernel with the metadata vLLM's CPU builder makes, i.e.
  the default backend's computation (greedy output token-identical to it:
  ``tests/integration/test_sparse_prefill.py``), plus the backend's timers;
* ``accelerated``: ``ACCEL_SPARSE_PREFILL`` with its default knobs;
* ``oracle`` (plans with ``extra_sides``): the quality tasks again, with key blocks chosen by
  their *true* attention mass (``method=oracle``) under a top-k budget equal to the density the
  accelerated side achieved at the headline length — what a perfect estimator would score at
  the same density.

Attention-only time is measured inside the worker process: the backend times its attention
kernels per layer (vLLM's kernel for dense requests; scoring + the block-sparse kernel for
sparse ones) and, with the ``stats_path`` knob the harness sets per side, appends one JSON line
per engine step; the engine worker attaches the lines of each latency request, and the harness
sums the prefill steps (``harness.worker_stats_summary``). Density is selected / causal key
blocks over the sparse layers of those steps. TTFT includes everything else the engine does
(MLPs, projections, sampling), so ``ttft_speedup`` is the end-to-end gain and
``attention_speedup`` the part the backend owns.
"""

from __future__ import annotations

from typing import Any

BACKEND = "ACCEL_SPARSE_PREFILL"
SECTION = "sparse_prefill"


#: Both sides run in float32: CPUs without AVX512-BF16/AMX emulate bf16 matrix products (6x
#: slower than fp32 on the 2-core AVX2 machine the defaults were measured on), which would bury
#: the attention time under MLP time and make every prefill several times longer.
DTYPE = "float32"


def engine_extra(**knobs: Any) -> dict[str, Any]:
    """Engine settings that select the backend with the given ``sparse_prefill`` knobs."""
    extra: dict[str, Any] = {"attention_backend": BACKEND, "dtype": DTYPE}
    if knobs:
        extra["additional_config"] = {"vllm_accel": {SECTION: dict(knobs)}}
    return extra


def oracle_at_same_density(plan, accelerated: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``oracle`` side: true-mass top-k at the accelerated side's headline density."""
    by_length = accelerated.get("by_prompt_length") or {}
    if not by_length:
        return {}
    density = by_length[max(by_length)].get("density")
    if density is None:  # the accelerated side never went sparse: nothing to compare
        return {}
    return {"oracle": engine_extra(method="oracle", tau=None, density=round(density, 4))}
