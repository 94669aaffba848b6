"""The benchmark definition of each feature: what the baseline is, what is accelerated.

A feature issue adds its entry to :data:`FEATURES` (its headline configuration as the quick
plan, the wider sweep as the full plan). Engine settings are ``vllm.EngineArgs`` fields.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_accel.bench import kv_quant, sparse_prefill

#: Every task a plan can run (``vllm_accel.bench.workloads``), in run order.
ALL_TASKS = ("latency", "throughput", "identity", "needle", "retrieval", "perplexity")


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
    #: The tasks to run (a subset of ``ALL_TASKS``); metrics of skipped tasks are reported as
    #: missing, not as zero.
    tasks: tuple[str, ...] = ALL_TASKS
    retrieval_kinds: tuple[str, ...] = ("multikey", "multivalue")
    #: Also run the feature's extra quality-only sides (``FeatureBench.extra_sides``).
    extra_sides: bool = False
    #: Run the baseline and accelerated engines this many times in turn (B A B A ...), each
    #: round timing the latency prompts again, so slow drift in a shared machine's speed falls
    #: on both sides; the other tasks run in the first round only. Latency medians pool every
    #: round, and ``ratios_by_round`` in the JSON shows the spread between rounds.
    rounds: int = 1

    def check(self) -> None:
        """Raise ValueError naming the field when a value is not one the harness knows."""
        unknown = set(self.tasks) - set(ALL_TASKS)
        if unknown:
            raise ValueError(f"bench --set tasks: unknown {sorted(unknown)}; choose from "
                             f"{', '.join(ALL_TASKS)}")
        if self.rounds < 1:
            raise ValueError("bench --set rounds: must be >= 1")


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
    #: Config section whose ``stats_path`` knob makes the backend append one JSON line per
    #: engine step (attention time, density); the harness gives each side its own file and
    #: reports the attention time and density of each latency request.
    stats_section: str | None = None
    #: ``(plan, accelerated side summary) -> {label: engine settings}``: more sides that run
    #: only the quality tasks, after the accelerated side (e.g. an oracle at the same density).
    extra_sides: Callable[[BenchPlan, dict[str, Any]], dict[str, dict[str, Any]]] | None = None
    #: ``(baseline summary, accelerated summary) -> (ratios, quality)``: the feature's own
    #: entries, added to the JSON next to the common ones (e.g. KV capacity of a cache dtype).
    extra_report: Callable[[dict[str, Any], dict[str, Any]],
                           tuple[dict[str, Any], dict[str, Any]]] | None = None
    #: ``(engine settings) -> engine settings``: last say on a side's settings once the model
    #: is known (e.g. a KV budget net of the memory a cache format keeps outside it).
    finish_engine: Callable[[dict[str, Any]], dict[str, Any]] | None = None


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
        FeatureBench(
            name="sparse-prefill",
            summary="ACCEL_SPARSE_PREFILL (block-sparse attention for long prefills) vs dense "
            "attention through vLLM's CPU kernel (method=dense), same engine settings",
            model="qwen2.5-coder-0.5b-instruct",
            baseline=sparse_prefill.engine_extra(method="dense"),
            accelerated=sparse_prefill.engine_extra(),
            stats_section=sparse_prefill.SECTION,
            extra_sides=sparse_prefill.oracle_at_same_density,
            # one 16K prompt per side: a dense 16K prefill alone takes ~5.5 min on 2 cores
            quick=BenchPlan(prompt_lengths=(16384,), output_tokens=8, tasks=("latency",)),
            full=BenchPlan(
                prompt_lengths=(4096, 8192, 16384, 32000),
                output_tokens=16,
                tasks=("latency", "needle", "retrieval"),
                needle_lengths=(4096, 8192, 16384, 32000),
                retrieval_lengths=(8192, 16384, 32000),
                retrieval_kinds=("multikey", "multivalue"),
                retrieval_samples=5,
                extra_sides=True,
            ),
        ),
        FeatureBench(
            name="speed",
            summary="ACCEL_SPEED (shallow prefill, deep decode; default cut 0.75) vs vLLM's own "
            "CPU attention, same engine settings; float32 on both sides",
            model="qwen2.5-coder-0.5b-instruct",
            # a fixed KV-cache size on both sides, so that peak usage fractions compare bytes
            baseline={"dtype": "float32", "kv_cache_memory_bytes": 2 * 2**30},
            accelerated={"attention_backend": "ACCEL_SPEED", "dtype": "float32",
                         "kv_cache_memory_bytes": 2 * 2**30},
            quick=BenchPlan(prompt_lengths=(8192,), output_tokens=32, tasks=("latency",)),
            full=BenchPlan(
                prompt_lengths=(2048, 8192, 16384),
                output_tokens=64,
                tasks=("latency", "needle", "retrieval"),
                needle_lengths=(2048, 8192),
                retrieval_lengths=(2048,),
                retrieval_kinds=("multikey",),
                retrieval_samples=3,
            ),
        ),
        FeatureBench(
            name="kv-quant",
            summary="--kv-cache-dtype kivi_4bit vs the bf16 cache (auto), bfloat16 models and "
            "the same KV-cache bytes on both sides: tokens admitted, speed, quality",
            model="qwen2.5-coder-0.5b-instruct",
            baseline=kv_quant.engine_extra("auto"),
            accelerated=kv_quant.engine_extra(kv_quant.DEFAULT_DTYPE),
            extra_report=kv_quant.report,
            extra_sides=kv_quant.other_value_rotation,
            finish_engine=kv_quant.finish_engine,
            # bf16 is emulated on AVX2 CPUs (slow): one 2K prompt, a 2K needle sweep, 2 windows
            quick=BenchPlan(prompt_lengths=(2048,), output_tokens=32,
                            tasks=("latency", "needle", "perplexity"),
                            needle_lengths=(2048,), ppl_windows=2, ppl_window_tokens=1024),
            full=BenchPlan(
                prompt_lengths=(2048, 4096, 8192),
                output_tokens=64,
                tasks=("latency", "throughput", "needle", "retrieval", "perplexity"),
                needle_lengths=(4096, 8192, 16384),
                retrieval_lengths=(4096, 8192),
                retrieval_samples=3,
                ppl_windows=8,
                ppl_window_tokens=1024,
            ),
        ),
    )
}


def plan_with_overrides(plan: Any, settings: list[str]) -> Any:
    """``plan`` (a frozen dataclass: :class:`BenchPlan`, or the spec-decode bench's plan) with
    ``FIELD=VALUE`` settings applied (``bench --set``); lists comma-separated::

        needle_lengths=4096,8192  tasks=latency,needle  retrieval_samples=3  extra_sides=false
    """
    hints = typing.get_type_hints(type(plan))
    changes: dict[str, Any] = {}
    for setting in settings:
        name, sep, text = setting.partition("=")
        if not sep or name not in hints:
            raise ValueError(f"bench --set {setting!r}: expected FIELD=VALUE with FIELD one of "
                             f"{', '.join(f.name for f in dataclasses.fields(plan))}")
        hint = hints[name]
        try:
            if typing.get_origin(hint) is tuple:
                item = typing.get_args(hint)[0]
                changes[name] = tuple(item(v) for v in text.split(",") if v)
            elif hint is bool:
                if text.lower() not in ("true", "false"):
                    raise ValueError(text)
                changes[name] = text.lower() == "true"
            else:
                changes[name] = hint(text)
        except ValueError:
            raise ValueError(f"bench --set {setting!r}: {text!r} is not a {hint}") from None
    new = dataclasses.replace(plan, **changes)
    check = getattr(new, "check", None)
    if check is not None:
        check()
    return new


def get_feature(name: str) -> FeatureBench:
    if name not in FEATURES:
        raise ValueError(f"unknown benchmark feature {name!r}: choose one of {', '.join(FEATURES)}")
    return FEATURES[name]
