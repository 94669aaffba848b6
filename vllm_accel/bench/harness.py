"""Run a feature benchmark: both sides in the same run, then ratios and quality."""

from __future__ import annotations

import json
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
             timeout_s: float, log_dir: Path) -> dict[str, Any]:
    """Run one engine configuration in a fresh process; return the worker's JSON result."""
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = {"engine": engine, "tasks": tasks, "env": {}}
    env = engine_env()
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


def _by_length(latency: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    groups: dict[int, list[dict[str, Any]]] = {}
    for rec in latency:
        groups.setdefault(rec["prompt_tokens"], []).append(rec)
    return {
        n: {
            "ttft_s": statistics.median(r["ttft_s"] for r in recs),
            "tpot_s": statistics.median(r["tpot_s"] for r in recs if r["tpot_s"] is not None),
            "kv_blocks": statistics.median(r["kv_blocks"] for r in recs),
        }
        for n, recs in sorted(groups.items())
    }


def summarize(result: dict[str, Any], work: Workloads) -> dict[str, Any]:
    tasks = result["tasks"]
    needle_scores = [needle.score(c, o["text"]) for c, o in zip(work.needle_cases, tasks["needle"])]
    kinds: dict[str, list[float]] = {}
    for case, out in zip(work.retrieval_cases, tasks["retrieval"]):
        kinds.setdefault(case.kind, []).append(retrieval.score(case, out["text"]))
    return {
        "load_s": result["load_s"],
        "num_kv_blocks": result["num_kv_blocks"],
        "block_size": result["block_size"],
        "by_prompt_length": _by_length(tasks["latency"]),
        "throughput_tok_s": tasks["throughput"]["output_tok_per_s"],
        "needle_accuracy": sum(needle_scores) / max(len(needle_scores), 1),
        "retrieval": {k: sum(v) / len(v) for k, v in kinds.items()},
        "perplexity": perplexity.perplexity(tasks["perplexity"]),
    }


def compare(base: dict[str, Any], accel: dict[str, Any], base_raw: dict[str, Any],
            accel_raw: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    head = max(base["by_prompt_length"])  # the longest prompt is the headline configuration
    b, a = base["by_prompt_length"][head], accel["by_prompt_length"][head]
    ratios = {
        "headline_prompt_tokens": head,
        "ttft_speedup": b["ttft_s"] / a["ttft_s"],
        "tpot_speedup": b["tpot_s"] / a["tpot_s"],
        "throughput_ratio": accel["throughput_tok_s"] / base["throughput_tok_s"],
        "kv_memory_reduction": 1.0 - a["kv_blocks"] / b["kv_blocks"] if b["kv_blocks"] else 0.0,
    }
    ident = identity.compare([o["token_ids"] for o in base_raw["tasks"]["identity"]],
                             [o["token_ids"] for o in accel_raw["tasks"]["identity"]])
    quality = {
        "greedy_identity": ident["identical_fraction"],
        "greedy_first_divergence": ident["first_divergence"],
        "needle_baseline": base["needle_accuracy"],
        "needle_accelerated": accel["needle_accuracy"],
        "perplexity_baseline": base["perplexity"],
        "perplexity_accelerated": accel["perplexity"],
        **{f"{k}_baseline": v for k, v in base["retrieval"].items()},
        **{f"{k}_accelerated": v for k, v in accel["retrieval"].items()},
    }
    return ratios, quality


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
    sides = {}
    raw = {}
    for label, extra in (("baseline", feature.baseline), ("accelerated", feature.accelerated)):
        engine = engine_settings(model_dir, work.max_model_len, gpu_memory_utilization, extra)
        raw[label] = run_side(label, engine, work.tasks, timeout_s, log_dir)
        sides[label] = {"engine": engine, **summarize(raw[label], work)}
    ratios, quality = compare(sides["baseline"], sides["accelerated"], raw["baseline"],
                              raw["accelerated"])
    return {
        "feature": feature.name,
        "summary": feature.summary,
        "model": model_name,
        "vllm_version": raw["baseline"]["vllm_version"],
        "platform": raw["baseline"].get("platform", {}),
        "config": {"plan": plan.__dict__, "lossless": feature.lossless},
        "baseline": sides["baseline"],
        "accelerated": sides["accelerated"],
        "ratios": ratios,
        "quality": quality,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["vllm-accel"] + sys.argv[1:]),
    }
