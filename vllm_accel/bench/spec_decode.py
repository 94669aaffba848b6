"""``vllm-accel bench spec-decode``: vllm_accel's proposers vs vLLM's ngram vs no speculation.

One run starts five engines in turn (each in its own process, see
:func:`vllm_accel.bench.harness.run_side`) on the same prompts:

* ``no_spec`` — plain decoding;
* ``ngram``   — vLLM's prompt-lookup proposer
  (``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
  "prompt_lookup_min": 2}``);
* ``sam``       — ``vllm_accel.spec_decode.SAMProposer`` with the same K and default knobs;
* ``recycling`` — ``vllm_accel.spec_decode.RecyclingProposer`` (token recycling), same K;
* ``hybrid``    — ``vllm_accel.spec_decode.HybridProposer`` (SAM or recycling per request and
  step, or no draft), same K.

vLLM's ``suffix`` method is the closest upstream relative, but it needs the
``arctic-inference`` package, which has no binary wheel for this platform: not compared.

Each workload (:mod:`vllm_accel.bench.spec_workloads`) runs its prompts one at a time (batch
1, the setting speculation targets), greedy, ``max_tokens`` tokens each (EOS ignored, so every
configuration decodes the same number of tokens). Per workload and configuration it reports:

* mean accepted length: vLLM's definition, 1 + accepted / drafts (tokens per verified draft);
* acceptance rate: accepted / drafted tokens;
* tokens per step: decoded tokens / decode steps (1.0 without speculation; counts the steps
  where the proposer drafted nothing, so it compares proposers fairly). vLLM counts accepted
  tokens past ``max_tokens`` too (then discarded), so on short runs the mean accepted length is
  slightly flattering, and steps are estimated as max(decoded - accepted, drafts);
* TPOT (mean gap between output tokens after the first) and output tok/s (end to end,
  prefill included);
* greedy identity: the fraction of outputs token-identical to ``no_spec``.

``ratios.decode_speedup`` is TPOT(no_spec) / TPOT(best) per workload, where ``best`` is the
vllm_accel proposer with the lowest TPOT on that workload (named in ``ratios.best_proposer``),
and ``ratios.decode_speedup_vs_ngram`` TPOT(ngram) / TPOT(best) on the repetitive workloads;
``ratios.decode_speedup_by_proposer`` has every proposer's own speedup. All ratios come from
the same run (the machine's speed drifts between runs).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_accel.bench import spec_workloads
from vllm_accel.bench.harness import engine_settings, run_side
from vllm_accel.bench.report import save_figure

SAM_CLASS = "vllm_accel.spec_decode.SAMProposer"
#: The vllm_accel proposers compared, by configuration label.
PROPOSER_CLASSES = {"sam": SAM_CLASS,
                    "recycling": "vllm_accel.spec_decode.RecyclingProposer",
                    "hybrid": "vllm_accel.spec_decode.HybridProposer"}
ALL_CONFIGS = ("no_spec", "ngram", *PROPOSER_CLASSES)
SUFFIX_NOTE = ("vLLM's `suffix` method is not compared: it needs arctic-inference, which has "
               "no binary wheel for this platform (only the 0.3.0 sdist, built against vLLM "
               "0.26, which also installs a vLLM plugin of its own).")


@dataclass(frozen=True)
class SpecPlan:
    prompts_per_workload: int
    max_tokens: int
    num_speculative_tokens: int = 8
    max_model_len: int = 2048
    #: Engines per configuration. Round r runs the configurations in reverse order when r is
    #: odd (ABC CBA), so a slow phase of a shared machine does not favour one configuration.
    rounds: int = 1
    #: "auto": the model's dtype where the CPU has bf16 instructions, else float32 (see
    #: :func:`bench_dtype`). Every configuration runs with the same dtype.
    dtype: str = "auto"
    #: Configurations to run (``no_spec`` always runs: it is the baseline); empty: all.
    configs: tuple[str, ...] = ()
    workloads: tuple[str, ...] = spec_workloads.ALL_WORKLOADS

    def check(self) -> None:
        """Raise ValueError naming the field when a value is not one the bench knows."""
        for name, given, known in (("configs", self.configs, ALL_CONFIGS),
                                   ("workloads", self.workloads, spec_workloads.ALL_WORKLOADS)):
            unknown = set(given) - set(known)
            if unknown:
                raise ValueError(f"bench --set {name}: unknown {sorted(unknown)}; choose from "
                                 f"{', '.join(known)}")
        if not self.workloads:
            raise ValueError("bench --set workloads: name at least one workload")


def bench_dtype(requested: str = "auto") -> str:
    """The engine dtype for the benchmark.

    On x86 CPUs without AVX512-BF16 or AMX, vLLM's oneDNN bf16 linear cannot be created and it
    falls back to torch's bf16 matmul, which is 6-8x slower than float32 there (measured on an
    AVX2-only EPYC: 8 vs 67 GFLOP/s); speculation would then be measured against an
    artificially slow model. "auto" picks float32 on such CPUs and the model's dtype elsewhere.
    """
    if requested != "auto":
        return requested
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return "auto"
    if not flags or "avx512_bf16" in flags or "amx_bf16" in flags:
        return "auto"
    return "float32"


QUICK = SpecPlan(prompts_per_workload=2, max_tokens=96)
FULL = SpecPlan(prompts_per_workload=6, max_tokens=192, rounds=2)


def configs(k: int, sam_knobs: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Engine settings (EngineArgs fields) of each configuration. ``sam_knobs`` (the
    ``spec_decode`` knobs) go to every vllm_accel proposer: they share the section."""
    out: dict[str, dict[str, Any]] = {
        "no_spec": {},
        "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": k,
                                         "prompt_lookup_max": 4, "prompt_lookup_min": 2}},
    }
    for label, cls in PROPOSER_CLASSES.items():
        engine: dict[str, Any] = {"speculative_config": {
            "method": "custom_class", "model": cls, "num_speculative_tokens": k}}
        if sam_knobs:
            engine["additional_config"] = {"vllm_accel": {"spec_decode": dict(sam_knobs)}}
        out[label] = engine
    return out


def summarize_workload(records: list[dict[str, Any]], spec: dict[str, int],
                       eos_ids: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Metrics of one configuration on one workload (latency records of every round +
    spec-decode totals)."""
    out_tokens = sum(r["output_tokens"] for r in records)
    decoded = sum(r["output_tokens"] - 1 for r in records)  # tokens after the first
    decode_s = sum(r["tpot_s"] * (r["output_tokens"] - 1) for r in records if r["tpot_s"])
    e2e_s = sum(r["ttft_s"] + (r["tpot_s"] or 0.0) * (r["output_tokens"] - 1) for r in records)
    drafts, drafted, accepted = (spec["num_drafts"], spec["num_draft_tokens"],
                                 spec["num_accepted_tokens"])
    return {
        "requests": len(records),
        "output_tokens": out_tokens,
        "tpot_s": decode_s / decoded if decoded else None,
        "ttft_s": statistics.mean(r["ttft_s"] for r in records),
        "output_tok_per_s": out_tokens / e2e_s if e2e_s else None,
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        # each verified draft is one step; tokens accepted past max_tokens are discarded but
        # still counted by vLLM, hence the max()
        "tokens_per_step": decoded / max(decoded - accepted, drafts, 1),
        # EOS is ignored so that every configuration decodes max_tokens; an answer that ended
        # before that continues past its end (often repetitively), which flatters speculation.
        "ended_before_limit": sum(any(t in eos_ids for t in r["token_ids"]) for r in records)
        / max(len(records), 1),
    }


def _identity(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    same = sum(x["token_ids"] == y["token_ids"] for x, y in zip(a, b))
    return same / max(len(a), 1)


def _spec_totals(rounds: list[dict[str, Any]], task: str) -> dict[str, int]:
    totals: dict[str, int] = {}
    for result in rounds:
        for key, value in result["spec_decoding"]["by_task"][task].items():
            totals[key] = totals.get(key, 0) + value
    return totals


def compare(raw: dict[str, list[dict[str, Any]]], workloads: list[spec_workloads.Workload],
            eos_ids: frozenset[int] = frozenset()
            ) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, Any]]:
    """Per-workload metrics of every configuration (``raw[label]``: one worker result per
    round), and the headline ratios."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for w in workloads:
        table[w.name] = {}
        for label, rounds in raw.items():
            records = [rec for result in rounds for rec in result["tasks"][w.name]]
            row = summarize_workload(records, _spec_totals(rounds, w.name), eos_ids)
            row["greedy_identical"] = _identity(raw["no_spec"][0]["tasks"][w.name],
                                                rounds[0]["tasks"][w.name])
            table[w.name][label] = row
    ratios: dict[str, Any] = {"decode_speedup": {}, "decode_speedup_vs_ngram": {},
                              "ngram_decode_speedup": {}, "best_proposer": {},
                              "decode_speedup_by_proposer": {}}
    for w in workloads:
        rows = table[w.name]
        base = rows["no_spec"]["tpot_s"]
        ngram = rows["ngram"]["tpot_s"] if "ngram" in rows else None
        ours = {label: rows[label]["tpot_s"] for label in PROPOSER_CLASSES if label in rows}
        if ngram is not None:
            ratios["ngram_decode_speedup"][w.name] = base / ngram
        if not ours:  # a run of vLLM's configurations only
            continue
        best = min(ours, key=lambda label: ours[label])
        ratios["best_proposer"][w.name] = best
        ratios["decode_speedup"][w.name] = base / ours[best]
        for label, tpot in ours.items():
            ratios["decode_speedup_by_proposer"].setdefault(label, {})[w.name] = base / tpot
        if w.repetitive and ngram is not None:
            ratios["decode_speedup_vs_ngram"][w.name] = ngram / ours[best]
    rep = [w.name for w in workloads if w.repetitive and w.name in ratios["decode_speedup"]]
    if rep:
        ratios["decode_speedup_repetitive_geomean"] = statistics.geometric_mean(
            ratios["decode_speedup"][n] for n in rep)
    if "open_chat" in ratios["decode_speedup"]:
        ratios["open_chat_slowdown"] = 1 - ratios["decode_speedup"]["open_chat"]
    return table, ratios


def run(model_dir: str, model_name: str, plan: SpecPlan, gpu_memory_utilization: float,
        log_dir: Path, sam_knobs: dict[str, Any] | None = None,
        timeout_s: float = 3600) -> dict[str, Any]:
    from vllm_accel.quality.prompts import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    workloads = spec_workloads.build(tokenizer, plan.prompts_per_workload, plan.workloads)
    # A short warm-up request first, so one-time costs (first drafts, JIT) hit no workload.
    tasks = [{"kind": "latency", "name": "warmup", "prompts": [workloads[0].prompts[0]],
              "max_tokens": 16}]
    tasks += [{"kind": "latency", "name": w.name, "prompts": w.prompts,
               "max_tokens": plan.max_tokens} for w in workloads]
    engines = {label: engine_settings(model_dir, plan.max_model_len, gpu_memory_utilization,
                                      {"dtype": bench_dtype(plan.dtype), **extra})
               for label, extra in configs(plan.num_speculative_tokens, sam_knobs).items()
               if label == "no_spec" or not plan.configs or label in plan.configs}
    raw: dict[str, list[dict[str, Any]]] = {label: [] for label in engines}
    for r in range(plan.rounds):
        for label in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            name = label if plan.rounds == 1 else f"{label}-{r}"
            raw[label].append(run_side(name, engines[label], tasks, timeout_s, log_dir))
    table, ratios = compare(raw, workloads, _eos_ids(tokenizer, model_dir))
    return {
        "feature": "spec-decode",
        "summary": ("vllm_accel's model-free proposers (SAMProposer, RecyclingProposer, "
                    "HybridProposer) vs vLLM ngram vs no speculation"),
        "model": model_name,
        "vllm_version": raw["no_spec"][0]["vllm_version"],
        "platform": raw["no_spec"][0].get("platform", {}),
        "config": {"plan": asdict(plan), "engines": engines,
                   "workloads": {w.name: {"prompts": len(w.prompts), "repetitive": w.repetitive,
                                          "prompt_tokens": [len(p) for p in w.prompts]}
                                 for w in workloads}},
        "workloads": table,
        "ratios": ratios,
        "notes": [SUFFIX_NOTE, "batch 1, greedy, EOS ignored; ratios from this run only"],
        # the reference outputs, for offline analysis of proposers
        "no_spec_outputs": {w.name: [{"prompt": p, "output": rec["token_ids"]}
                                     for p, rec in zip(w.prompts,
                                                       raw["no_spec"][0]["tasks"][w.name])]
                            for w in workloads},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["vllm-accel"] + sys.argv[1:]),
    }


def _eos_ids(tokenizer, model_dir: str) -> frozenset[int]:
    """The tokens that end an answer: the tokenizer's EOS and generation_config's."""
    import json

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = Path(model_dir, "generation_config.json")
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    return {"ms": f"{value * 1e3:.1f} ms", "x": f"{value:.2f}x", "pct": f"{value:.0%}",
            "f2": f"{value:.2f}", "f1": f"{value:.1f}"}[kind]


def table(result: dict[str, Any]) -> str:
    """The per-workload table and the ratios, as text."""
    header = ("workload", "config", "mean acc. len", "accept rate", "tokens/step", "TPOT",
              "out tok/s", "decode speedup", "greedy-identical", "ended early")
    rows = [header]
    for name, by_config in result["workloads"].items():
        base_tpot = by_config["no_spec"]["tpot_s"]
        for label, r in by_config.items():
            rows.append((name, label, _fmt(r["mean_accepted_length"], "f2"),
                         _fmt(r["acceptance_rate"], "pct"), _fmt(r["tokens_per_step"], "f2"),
                         _fmt(r["tpot_s"], "ms"), _fmt(r["output_tok_per_s"], "f1"),
                         _fmt(base_tpot / r["tpot_s"] if r["tpot_s"] else None, "x"),
                         _fmt(r["greedy_identical"], "pct"),
                         _fmt(r["ended_before_limit"], "pct")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    plan, platform = result["config"]["plan"], result["platform"]
    head = (f"spec-decode on {result['model']} (vLLM {result['vllm_version']}, "
            f"{platform.get('device', '?')}, {platform.get('cpus', '?')} cpus): K="
            f"{plan['num_speculative_tokens']}, {plan['prompts_per_workload']} prompts x "
            f"{plan['max_tokens']} tokens per workload, batch 1, greedy, "
            f"{plan['rounds']} round(s)")
    r = result["ratios"]
    best = r.get("best_proposer", {})
    ratio_lines = [
        "decode speedup, best vllm_accel proposer vs no spec: " + ", ".join(
            f"{k} {v:.2f}x ({best.get(k, 'sam')})" for k, v in r["decode_speedup"].items()),
        "decode speedup, best vllm_accel proposer vs ngram:   " + ", ".join(
            f"{k} {v:.2f}x" for k, v in r["decode_speedup_vs_ngram"].items()),
    ]
    if "open_chat_slowdown" in r:
        ratio_lines.append(f"open chat slowdown (best vllm_accel proposer vs no spec): "
                           f"{r['open_chat_slowdown']:+.1%}")
    return "\n".join([head, *lines, *ratio_lines, *result["notes"][:1]])


def write_plot(result: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    first = result["workloads"][names[0]]
    labels = [label for label in ("ngram", *PROPOSER_CLASSES) if label in first]
    width = 0.8 / len(labels)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for j, label in enumerate(labels):
        offset = (j - (len(labels) - 1) / 2) * width
        speedups = [result["workloads"][n]["no_spec"]["tpot_s"]
                    / result["workloads"][n][label]["tpot_s"] for n in names]
        steps = [result["workloads"][n][label]["tokens_per_step"] or 1.0 for n in names]
        axes[0].bar([i + offset for i in range(len(names))], speedups, width, label=label)
        axes[1].bar([i + offset for i in range(len(names))], steps, width, label=label)
    for ax, title in ((axes[0], "decode speedup vs no speculation (TPOT)"),
                      (axes[1], "tokens per decode step")):
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
        ax.legend()
    save_figure(fig, f"spec-decode on {result['model']}", path)
