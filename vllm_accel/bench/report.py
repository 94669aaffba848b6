"""Present a benchmark result: a side-by-side table, a JSON file and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if unit == "ms":
            return f"{value * 1e3:.1f} ms"
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def _x(num: Any, den: Any) -> str:
    return f"{num / den:.2f}x" if num is not None and den else ""


def table(result: dict[str, Any]) -> str:
    base, accel = result["baseline"], result["accelerated"]
    extra = result.get("extra_sides", {})
    rows = [("metric", "baseline", "accelerated", "ratio")]
    for n, b in base["by_prompt_length"].items():
        a = accel["by_prompt_length"][n]
        rows.append((f"TTFT @ {n} tok", _fmt(b["ttft_s"], "ms"), _fmt(a["ttft_s"], "ms"),
                     _x(b["ttft_s"], a["ttft_s"])))
        if "attention_s" in b or "attention_s" in a:
            rows.append((f"attention time @ {n} tok", _fmt(b.get("attention_s"), "ms"),
                         _fmt(a.get("attention_s"), "ms"),
                         _x(b.get("attention_s"), a.get("attention_s"))))
            rows.append((f"density @ {n} tok", _fmt(b.get("density")), _fmt(a.get("density")),
                         ""))
        rows.append((f"TPOT @ {n} tok", _fmt(b["tpot_s"], "ms"), _fmt(a["tpot_s"], "ms"),
                     _x(b["tpot_s"], a["tpot_s"])))
        if b.get("kv_usage") is not None and a.get("kv_usage") is not None:
            # peak share of the KV cache one request takes (comparable across KV-group layouts)
            rows.append((f"KV cache use @ {n} tok", f"{b['kv_usage']:.1%}", f"{a['kv_usage']:.1%}",
                         f"{a['kv_usage'] / b['kv_usage'] - 1:+.0%}" if b["kv_usage"] else ""))
            rows.append((f"max concurrent @ {n} tok", _fmt(b["max_concurrency"]),
                         _fmt(a["max_concurrency"]), ""))
        else:
            rows.append((f"KV blocks @ {n} tok", _fmt(b["kv_blocks"]), _fmt(a["kv_blocks"]), ""))
    r = result["ratios"]
    if base.get("throughput_tok_s") is not None:
        rows.append(("throughput (tok/s)", _fmt(base["throughput_tok_s"]),
                     _fmt(accel["throughput_tok_s"]), _x(accel["throughput_tok_s"],
                                                         base["throughput_tok_s"])))
    q = result["quality"]

    def extra_note(key: str) -> str:
        def changed(label: str) -> str:  # retrieval: cases worse/better against the baseline
            worse = q.get(f"{key}_cases_worse_{label}")
            better = q.get(f"{key}_cases_better_{label}")
            return "" if worse is None else f" (cases worse/better: {worse}/{better})"

        return "; ".join(f"{label}: {_fmt(q.get(f'{key}_{label}'))}{changed(label)}"
                         for label in extra)

    if q.get("needle_baseline") is not None:
        rows.append(("needle accuracy", _fmt(q["needle_baseline"]),
                     _fmt(q["needle_accelerated"]), extra_note("needle")))
    for kind in ("multikey", "multivalue"):
        if f"{kind}_baseline" in q:
            changed = (f"cases worse/better: {q[f'{kind}_cases_worse']}/"
                       f"{q[f'{kind}_cases_better']}" if f"{kind}_cases_worse" in q else "")
            if changed and f"{kind}_sign_test_p" in q:
                changed += f" (sign test p={q[f'{kind}_sign_test_p']:.2g})"
            rows.append((f"{kind} retrieval", _fmt(q[f"{kind}_baseline"]),
                         _fmt(q[f"{kind}_accelerated"]),
                         "; ".join(n for n in (changed, extra_note(kind)) if n)))
    if q.get("perplexity_baseline") is not None:
        rows.append(("perplexity", _fmt(q["perplexity_baseline"]),
                     _fmt(q["perplexity_accelerated"]),
                     f"{q['perplexity_accelerated'] / q['perplexity_baseline'] - 1:+.1%}"))
    if q.get("top1_agreement") is not None:
        rows.append(("top-1 agreement with baseline", "", f"{q['top1_agreement']:.1%}",
                     f"mean |d log p| {q['mean_abs_logprob_delta']:.3f}"))
    if "greedy_identity" in q:
        rows.append(("greedy-identical outputs", "", f"{q['greedy_identity']:.0%}", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    head = (f"{result['feature']} on {result['model']} (vLLM {result['vllm_version']}, "
            f"{result['platform'].get('device', '?')}, {result['platform'].get('cpus', '?')} cpus)")
    summary = ", ".join(f"{k}={v:.3g}" for k, v in r.items() if isinstance(v, float))
    lines = [head, *lines, f"ratios: {summary}"]
    for n in base["by_prompt_length"] if "ratios_by_round" in result else ():
        per_round = [r.get(n) or r.get(str(n)) or {} for r in result["ratios_by_round"]]
        lines.append(f"by round @ {n} tok (TTFT, TPOT speedup): " + "; ".join(
            f"{_fmt(r.get('ttft_speedup'))}, {_fmt(r.get('tpot_speedup'))}" for r in per_round))
    load = result.get("load_average", {})
    # "after" includes the engines' own threads (≈ the core count); only "before" tells of
    # other processes (the 1-minute average also remembers the last minute's work)
    if load.get("before", 0.0) > 0.5:
        lines.append(f"note: machine load average {load['before']:.1f} when the run started: if "
                     f"other processes were running, timings are distorted (rerun idle)")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


def write_plot(result: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base, accel = result["baseline"], result["accelerated"]
    lengths = list(base["by_prompt_length"])
    q = result["quality"]
    names = [k[: -len("_baseline")] for k in q
             if k.endswith("_baseline") and "perplexity" not in k and q[k] is not None]
    fig, axes = plt.subplots(1, 3 if names else 2, figsize=(14 if names else 10, 4))
    for ax, key, title in ((axes[0], "ttft_s", "TTFT (ms)"), (axes[1], "tpot_s", "TPOT (ms)")):
        for side, marker, label in ((base, "o-", "vLLM baseline"),
                                    (accel, "s-", result["feature"])):
            points = [(n, side["by_prompt_length"][n][key]) for n in lengths
                      if side["by_prompt_length"][n][key] is not None]
            ax.plot([n for n, _ in points], [v * 1e3 for _, v in points], marker, label=label)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.legend()
    if names:  # retrieval tasks ran (not with --quick)
        _retrieval_panel(axes[2], result, names)
    save_figure(fig, f"{result['feature']} vs vLLM on {result['model']} ({result['date']})",
                path)


def save_figure(fig: Any, title: str, path: str | Path) -> None:
    """Title, lay out and write a benchmark's matplotlib figure as a PNG, then free it."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _retrieval_panel(ax: Any, result: dict[str, Any], names: list[str]) -> None:
    q = result["quality"]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [q[f"{n}_baseline"] for n in names], 0.4, label="baseline")
    ax.bar([i + 0.2 for i in x], [q[f"{n}_accelerated"] for n in names], 0.4,
           label=result["feature"])
    ax.set_xticks(list(x), names)
    ax.set_ylim(0, 1.05)
    ax.set_title("retrieval accuracy")
    ax.legend()
