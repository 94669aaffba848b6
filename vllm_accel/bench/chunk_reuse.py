"""``vllm-accel bench chunk-reuse``: position-independent chunk reuse vs full recompute vs vLLM's
prefix cache, on multi-document QA.

One run starts one engine per side, in turn (each in its own process, see
:func:`vllm_accel.bench.harness.run_side`), on the same prompts
(:mod:`vllm_accel.bench.chunk_reuse_workload`), same model, float32, eager:

* ``full``         — no connector, no prefix cache: every prompt computed in full (the baseline);
* ``prefix_cache`` — vLLM's automatic prefix caching (reuses only a prompt's exact prefix);
* ``naive``        — ``ChunkReuseConnector`` with ``recompute=none`` (chunks re-rotated, nothing
  recomputed);
* ``epic``         — the connector with EPIC's recompute (the first ``epic_tokens`` of every
  reused chunk);
* ``cacheblend``   — CacheBlend's selective recompute (``recompute_ratio``);
* ``query``        — the connector's default policy: the tokens the question reads most, found
  by probing the loaded pages with it (``recompute_ratio``, ``query_window``);
* ``ape``, ``epic_ape`` — ``naive`` / ``epic`` plus APE's attention temperature and scale
  (``attention_temperature``, ``attention_scale``) for the question over the reused chunks.

Each side first runs a warm-up pass that presents every document once (untimed; it fills the
chunk store or the prefix cache), then the measured prompts, one at a time (batch 1): the same
documents in new shuffled orders with a question after them, greedy, ``max_tokens`` tokens. Per
prompt it records TTFT (the engine worker's submit-to-first-token time) and whether the answer
holds the expected access code(s); connector sides also report the connector's counters (the
last ``chunk reuse (worker|scheduler)`` lines of the engine log): the recompute fraction
(token-layers recomputed / claimed), reused requests, hit tokens.

``ratios.ttft_speedup`` is median TTFT(full) / median TTFT(default policy's side) at the largest
document count (``ratios.headline_num_chunks``); ``ratios.ttft_speedup_by_side`` has every side's.
``quality.accuracy_full`` / ``quality.accuracy_reuse`` (default policy) and
``quality.accuracy_<side>`` are the fractions of measured questions answered right. All from the
same run.
"""

from __future__ import annotations

import ast
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_accel.bench import chunk_reuse_workload as workload_mod
from vllm_accel.bench.harness import engine_settings, run_side
from vllm_accel.bench.report import save_figure
from vllm_accel.kv_connector.config import ChunkReuseConfig

#: Connector sides: the ``recompute`` policy each runs, and whether it adds APE attention.
CONNECTOR_SIDES = {"naive": ("none", False), "epic": ("epic", False),
                   "cacheblend": ("cacheblend", False), "query": ("query", False),
                   "ape": ("none", True),
                   "epic_ape": ("epic", True)}
ALL_SIDES = ("full", "prefix_cache", *CONNECTOR_SIDES)
DEFAULT_POLICY = ChunkReuseConfig().recompute  # the side that runs the default policy
CONNECTOR = {"kv_connector": "ChunkReuseConnector",
             "kv_connector_module_path": "vllm_accel.kv_connector", "kv_role": "kv_both"}
_COUNTERS = re.compile(r"chunk reuse \((worker|scheduler)\): ([^;\n]*)")


@dataclass(frozen=True)
class ChunkReusePlan:
    #: Documents per measured prompt; one set of questions per count. The document pool has
    #: ``max(num_chunks)`` documents; the warm-up presents each once.
    num_chunks: tuple[int, ...] = (8,)
    #: Tokens per document (an essay slice, trimmed to whole sentences, plus the fact).
    chunk_tokens: int = 512
    #: Measured prompts per document count, and how many of them need two documents.
    questions: int = 4
    two_doc_questions: int = 1
    #: Greedy tokens per answer (a two-code answer takes ~12 with digit-level tokenizers).
    max_tokens: int = 16
    #: Sides to run (``full`` always runs: it is the baseline); empty: all.
    sides: tuple[str, ...] = ()
    seed: int = 0
    dtype: str = "float32"
    #: Connector knobs (``kv_connector_extra_config``) of the connector sides.
    stores: tuple[str, ...] = ("memory",)
    epic_tokens: int = 16
    recompute_ratio: float = 0.15
    query_window: int = 4
    query_draft_tokens: int = 0
    min_reuse_tokens: int = 64
    #: APE knobs of the ``ape`` and ``epic_ape`` sides.
    attention_temperature: float = 0.5
    attention_scale: float = 1.0
    #: 0: the longest prompt plus ``max_tokens``, rounded up to 256.
    max_model_len: int = 0

    def check(self) -> None:
        """Raise ValueError naming the field when a value is not one the bench accepts."""
        unknown = set(self.sides) - set(ALL_SIDES)
        if unknown:
            raise ValueError(f"bench --set sides: unknown {sorted(unknown)}; choose from "
                             f"{', '.join(ALL_SIDES)}")
        if not self.num_chunks or min(self.num_chunks) < 1:
            raise ValueError("bench --set num_chunks: name at least one count, each >= 1")
        if self.chunk_tokens < 64:
            raise ValueError("bench --set chunk_tokens: must be >= 64")
        if self.questions < 1 or not 0 <= self.two_doc_questions <= self.questions:
            raise ValueError("bench --set questions/two_doc_questions: need questions >= 1 and "
                             "0 <= two_doc_questions <= questions")
        if self.max_tokens < 1:
            raise ValueError("bench --set max_tokens: must be >= 1")

    def side_labels(self) -> list[str]:
        return [s for s in ALL_SIDES if s == "full" or not self.sides or s in self.sides]


QUICK = ChunkReusePlan()
FULL = ChunkReusePlan(num_chunks=(4, 8, 10), chunk_tokens=1024, questions=8,
                      two_doc_questions=3)


def connector_config(policy: str, plan: ChunkReusePlan, ape: bool = False) -> dict[str, Any]:
    extra = {"recompute": policy, "stores": list(plan.stores), "epic_tokens": plan.epic_tokens,
             "recompute_ratio": plan.recompute_ratio, "query_window": plan.query_window,
             "query_draft_tokens": plan.query_draft_tokens if policy == "query" else 0,
             "min_reuse_tokens": plan.min_reuse_tokens,
             "save_new_chunks": True,
             # the side reads the last counters line of its log: log every step that loads or
             # saves, so the last line counts the last request (shutdown may kill the worker
             # before its final line)
             "log_interval_s": 0}
    if ape:
        extra.update(attention_temperature=plan.attention_temperature,
                     attention_scale=plan.attention_scale)
    return {**CONNECTOR, "kv_connector_extra_config": extra}


def side_engines(plan: ChunkReusePlan) -> dict[str, dict[str, Any]]:
    """The EngineArgs fields each side adds to the common settings."""
    out: dict[str, dict[str, Any]] = {}
    for label in plan.side_labels():
        extra: dict[str, Any] = {"dtype": plan.dtype, "enforce_eager": True,
                                 "enable_prefix_caching": label == "prefix_cache"}
        if label in CONNECTOR_SIDES:
            policy, ape = CONNECTOR_SIDES[label]
            extra["kv_transfer_config"] = connector_config(policy, plan, ape)
        out[label] = extra
    return out


def connector_counters(log: str) -> dict[str, dict[str, float]]:
    """The last ``chunk reuse (worker)`` and ``chunk reuse (scheduler)`` counters of an engine
    log, by side (absent when never logged)."""
    out: dict[str, dict[str, float]] = {}
    for side, text in _COUNTERS.findall(log):
        values = {}
        for item in text.split(","):
            name, sep, value = item.strip().partition("=")
            if sep:
                try:
                    values[name] = float(value)
                except ValueError:
                    continue
        out[side] = values
    return out


def logged_store_stats(log: str, side: str = "worker") -> dict[str, Any] | None:
    """The store counters on the last ``chunk reuse (<side>)`` line (``{tier: {counter: value},
    "total": ...}``), or ``None``."""
    found = re.findall(rf"chunk reuse \({side}\): [^;\n]*; stores: (\{{.*\}})", log)
    if not found:
        return None
    try:
        stats = ast.literal_eval(found[-1])
    except (ValueError, SyntaxError):
        return None
    return stats if isinstance(stats, dict) else None


def recompute_fraction(counters: dict[str, dict[str, float]]) -> float | None:
    """Token-layers recomputed / claimed over the run; 0.0 when chunks were reused and nothing
    recomputed (``recompute=none`` logs no fraction); ``None`` when nothing was reused."""
    worker = counters.get("worker", {})
    if "recompute_fraction" in worker:
        return worker["recompute_fraction"]
    if counters.get("scheduler", {}).get("reused_requests", 0) > 0:
        return 0.0
    return None


def max_model_len(plan: ChunkReusePlan, work: workload_mod.Workload) -> int:
    if plan.max_model_len:
        return plan.max_model_len
    need = work.max_prompt_tokens + plan.max_tokens + 8
    return -(-need // 256) * 256


def tasks(plan: ChunkReusePlan, work: workload_mod.Workload) -> list[dict[str, Any]]:
    """Warm-up (every document once, untimed), then one latency task per document count."""
    out: list[dict[str, Any]] = [{"kind": "generate", "name": "warmup", "sequential": True,
                                  "prompts": [list(p) for p in work.warmup], "max_tokens": 1}]
    for n, questions in work.by_num_chunks().items():
        out.append({"kind": "latency", "name": f"chunks_{n}", "max_tokens": plan.max_tokens,
                    "prompts": [list(q.prompt) for q in questions]})
    return out


def answer_text(token_ids: list[int], decode: Callable[[list[int]], str],
                eos_ids: frozenset[int]) -> str:
    """The answer up to its first end-of-sequence token (latency tasks ignore EOS)."""
    end = next((i for i, t in enumerate(token_ids) if t in eos_ids), len(token_ids))
    return decode(token_ids[:end])


def summarize_side(raw: dict[str, Any], work: workload_mod.Workload,
                   decode: Callable[[list[int]], str], eos_ids: frozenset[int] = frozenset(),
                   counters: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """One side's TTFT and accuracy per document count, its answers and connector counters."""
    by_n: dict[int, dict[str, Any]] = {}
    answers = []
    for n, questions in work.by_num_chunks().items():
        records = raw["tasks"][f"chunks_{n}"]
        correct = []
        for q, rec in zip(questions, records):
            text = answer_text(rec["token_ids"], decode, eos_ids)
            correct.append(workload_mod.score(q.expected, text))
            answers.append({"num_chunks": n, "question": q.text, "expected": list(q.expected),
                            "order": list(q.order), "targets": list(q.targets), "output": text,
                            "correct": correct[-1], "ttft_s": rec["ttft_s"],
                            "prompt_tokens": rec["prompt_tokens"]})
        ttfts = [rec["ttft_s"] for rec in records]
        by_n[n] = {"ttft_s": statistics.median(ttfts), "ttft_mean_s": statistics.mean(ttfts),
                   "accuracy": sum(correct) / len(correct),
                   "prompt_tokens": statistics.median(rec["prompt_tokens"] for rec in records),
                   "prefix_cache_hit_tokens": raw.get("events", {}).get(f"chunks_{n}", {})
                   .get("prefix_cache_hit_tokens")}
    counters = counters or {}
    return {
        "load_s": raw.get("load_s"),
        "by_num_chunks": by_n,
        "accuracy": sum(a["correct"] for a in answers) / len(answers),
        "recompute_fraction": recompute_fraction(counters),
        "connector": counters or None,
        "answers": answers,
    }


def compare(sides: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Headline ratios (TTFT speedups vs ``full``) and quality (accuracies) of the sides."""
    full = sides["full"]["by_num_chunks"]
    head = max(full)

    def speedups(n: int) -> dict[str, float | None]:
        return {label: (full[n]["ttft_s"] / side["by_num_chunks"][n]["ttft_s"]
                        if side["by_num_chunks"][n]["ttft_s"] else None)
                for label, side in sides.items() if label != "full"}

    by_side = speedups(head)
    ratios = {"headline_num_chunks": head, "default_policy": DEFAULT_POLICY,
              "ttft_speedup": by_side.get(DEFAULT_POLICY), "ttft_speedup_by_side": by_side,
              "ttft_speedup_by_num_chunks": {n: speedups(n) for n in full}}
    quality: dict[str, Any] = {"accuracy_full": sides["full"]["accuracy"],
                               "accuracy_reuse": sides.get(DEFAULT_POLICY, {}).get("accuracy")}
    quality.update({f"accuracy_{label}": side["accuracy"] for label, side in sides.items()
                    if label != "full"})
    quality["accuracy_by_num_chunks"] = {
        n: {label: side["by_num_chunks"][n]["accuracy"] for label, side in sides.items()}
        for n in full}
    return ratios, quality


def run(model_dir: str, model_name: str, plan: ChunkReusePlan, gpu_memory_utilization: float,
        log_dir: Path, timeout_s: float = 3600) -> dict[str, Any]:
    from vllm_accel.bench.spec_decode import _eos_ids
    from vllm_accel.quality.prompts import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    work = workload_mod.build(tokenizer, plan.num_chunks, plan.chunk_tokens, plan.questions,
                              plan.two_doc_questions, plan.seed)
    eos_ids = _eos_ids(tokenizer, model_dir)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: load average is {load_before:.1f} before the benchmark; other "
              f"processes on the cores distort TTFT. Run benchmarks on an idle machine.",
              file=sys.stderr)
    length = max_model_len(plan, work)
    engines = {label: engine_settings(model_dir, length, gpu_memory_utilization, extra)
               for label, extra in side_engines(plan).items()}
    task_list = tasks(plan, work)
    sides: dict[str, dict[str, Any]] = {}
    raw: dict[str, dict[str, Any]] = {}
    for label, engine in engines.items():
        raw[label] = run_side(label, engine, task_list, timeout_s, log_dir)
        log = (log_dir / f"{label}.log").read_text(errors="replace")
        counters = connector_counters(log) if label in CONNECTOR_SIDES else None
        sides[label] = summarize_side(raw[label], work, decode, eos_ids, counters)
    ratios, quality = compare(sides)
    return {
        "feature": "chunk-reuse",
        "summary": ("ChunkReuseConnector (position-independent chunk KV reuse; naive, EPIC, "
                    "CacheBlend, query-driven) vs full recompute vs vLLM prefix caching, "
                    "multi-document QA"),
        "model": model_name,
        "vllm_version": raw["full"]["vllm_version"],
        "platform": raw["full"].get("platform", {}),
        "config": {"plan": asdict(plan), "engines": engines, "workload": {
            "separator": work.separator,
            "documents": [{"archive": d.archive, "code": d.code, "essay": d.essay,
                           "tokens": len(d.token_ids)} for d in work.documents],
            "warmup_prompts": len(work.warmup),
            "prompt_tokens": {n: [len(q.prompt) for q in qs]
                              for n, qs in work.by_num_chunks().items()}}},
        "sides": sides,
        "ratios": ratios,
        "quality": quality,
        "recompute_fraction": {label: side["recompute_fraction"] for label, side in sides.items()
                               if label in CONNECTOR_SIDES},
        "notes": [
            "TTFT: median over the measured prompts of each document count, one prompt at a "
            "time, after an untimed warm-up that presents every document once",
            "connector counters cover the whole engine run (the warm-up saves chunks and "
            "reuses none)",
        ],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "command": " ".join(["vllm-accel"] + sys.argv[1:]),
    }


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    return {"ms": f"{value * 1e3:.1f} ms", "x": f"{value:.2f}x", "pct": f"{value:.0%}",
            "pct1": f"{value:.1%}", "int": f"{value:.0f}"}[kind]


def table(result: dict[str, Any]) -> str:
    """Per document count and side: TTFT, speedup, accuracy, recompute fraction; then the
    headline ratios."""
    header = ("chunks", "side", "prompt tok", "TTFT (median)", "TTFT speedup", "accuracy",
              "recompute", "reused req.", "hit tokens")
    rows = [header]
    sides = result["sides"]
    for n, full in sides["full"]["by_num_chunks"].items():
        for label, side in sides.items():
            row = side["by_num_chunks"][n]
            scheduler = (side.get("connector") or {}).get("scheduler", {})
            hits = (scheduler.get("hit_tokens") if label in CONNECTOR_SIDES
                    else row.get("prefix_cache_hit_tokens") if label == "prefix_cache" else None)
            rows.append((str(n), label, _fmt(row["prompt_tokens"], "int"),
                         _fmt(row["ttft_s"], "ms"),
                         _fmt(full["ttft_s"] / row["ttft_s"] if row["ttft_s"] else None, "x"),
                         _fmt(row["accuracy"], "pct"),
                         _fmt(side.get("recompute_fraction"), "pct1"),
                         _fmt(scheduler.get("reused_requests"), "int"), _fmt(hits, "int")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    plan, platform = result["config"]["plan"], result["platform"]
    head = (f"chunk-reuse on {result['model']} (vLLM {result['vllm_version']}, "
            f"{platform.get('device', '?')}, {platform.get('cpus', '?')} cpus): "
            f"{'/'.join(str(n) for n in plan['num_chunks'])} documents of ~"
            f"{plan['chunk_tokens']} tokens, {plan['questions']} questions per count "
            f"({plan['two_doc_questions']} need two documents), batch 1, greedy, "
            f"{plan['dtype']}")
    r, q = result["ratios"], result["quality"]
    out = [head, *lines,
           f"TTFT speedup vs full recompute @ {r['headline_num_chunks']} documents: "
           + ", ".join(f"{k} {_fmt(v, 'x')}" for k, v in r["ttft_speedup_by_side"].items()),
           f"accuracy: full {_fmt(q['accuracy_full'], 'pct')}, "
           f"{DEFAULT_POLICY} (default policy) {_fmt(q['accuracy_reuse'], 'pct')}"]
    load = result.get("load_average", {})
    if load.get("before", 0.0) > 0.5:
        out.append(f"note: machine load average {load['before']:.1f} when the run started: if "
                   f"other processes were running, timings are distorted (rerun idle)")
    return "\n".join(out)


def write_plot(result: dict[str, Any], path: str | Path) -> None:
    """Accuracy vs TTFT per side (headline document count), and TTFT per document count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = result["sides"]
    head = result["ratios"]["headline_num_chunks"]
    counts = list(sides["full"]["by_num_chunks"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, side in sides.items():
        row = side["by_num_chunks"][head]
        axes[0].scatter([row["ttft_s"] * 1e3], [row["accuracy"]], s=60, label=label)
        axes[0].annotate(label, (row["ttft_s"] * 1e3, row["accuracy"]),
                         textcoords="offset points", xytext=(5, 5))
        axes[1].plot(counts, [side["by_num_chunks"][n]["ttft_s"] * 1e3 for n in counts], "o-",
                     label=label)
    axes[0].set_xlabel(f"TTFT, median (ms) @ {head} documents")
    axes[0].set_ylabel("accuracy")
    axes[0].set_ylim(-0.05, 1.05)
    axes[0].set_xlim(left=0)
    axes[0].set_title("accuracy vs TTFT")
    axes[1].set_xlabel("documents per prompt")
    axes[1].set_ylabel("TTFT, median (ms)")
    axes[1].set_ylim(bottom=0)
    axes[1].set_xticks(counts)
    axes[1].set_title("TTFT by document count")
    axes[1].legend()
    save_figure(fig, f"chunk-reuse on {result['model']} ({result.get('date', '')})", path)
