"""The benchmark definition of each feature: what the baseline is, what is accelerated.

A feature issue adds its entry to :data:`FEATURES` (its headline configuration as the quick
plan, the wider sweep as the full plan). Engine settings are ``vllm.EngineArgs`` fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BenchPlan:
    """What to measure; the quick plan is the feature's headline configuration, run once."""

    prompt_lengths: tuple[int, ...] = (512, 2048)
    output_tokens: int = 32
    repetitions: int = 1
    throughput_requests: int = 8
    throughput_prompt_tokens: int = 256
    throughput_output_tokens: int = 64
    identity_prompts: int = 8
    identity_output_tokens: int = 48
    needle_lengths: tuple[int, ...] = (1024,)
    needle_depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    retrieval_lengths: tuple[int, ...] = (1024,)
    retrieval_samples: int = 2
    ppl_windows: int = 4
    ppl_window_tokens: int = 512


@dataclass(frozen=True)
class FeatureBench:
    name: str
    summary: str
    model: str
    accelerated: dict[str, Any]
    baseline: dict[str, Any] = field(default_factory=dict)
    quick: BenchPlan = BenchPlan()
    full: BenchPlan = BenchPlan()
    lossless: bool = False  # greedy output must be token-identical to the baseline


FEATURES: dict[str, FeatureBench] = {
    f.name: f
    for f in (
        FeatureBench(
            name="base",
            summary="ACCEL_BASE (dense attention through the plugin) vs vLLM's own backend: "
            "the plugin's overhead and transparency",
            model="smollm2-135m-instruct",
            accelerated={"attention_backend": "ACCEL_BASE"},
            lossless=True,
            quick=BenchPlan(),
            full=BenchPlan(
                prompt_lengths=(512, 2048, 4096, 7168),
                repetitions=3,
                throughput_requests=32,
                identity_prompts=32,
                needle_lengths=(1024, 2048, 4096),
                retrieval_lengths=(1024, 2048, 4096),
                retrieval_samples=5,
                ppl_windows=16,
            ),
        ),
    )
}


def get_feature(name: str) -> FeatureBench:
    if name not in FEATURES:
        raise ValueError(f"unknown benchmark feature {name!r}: choose one of {', '.join(FEATURES)}")
    return FEATURES[name]
