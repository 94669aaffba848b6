"""``vllm-accel calibrate speed``: the quality/savings curve of SPEED's cut on a real model.

Off-the-shelf weights were not trained for SPEED, so how deep prompt tokens must go is a
property of the model. This sweep runs the PyTorch oracle (:mod:`.reference`: the exact policy,
with real compute skip) on a small calibration set, for each cut:

* **needle**: a fact hidden at several depths of essay text, greedy answer checked;
* **multi-key retrieval**: four key/value facts in essay text, the value of one asked for;
* **continuation perplexity**: essays split into a prompt and a continuation; the continuation
  is scored token by token as decode tokens (full depth), after a SPEED prefill of the prompt
  (the quantity SPEED changes: how well decoding sees a prompt it only read shallowly);
* **code perplexity**: the same continuation scoring on Python standard-library files (the
  split :func:`vllm_accel.speed.adapt.data.code_files` keeps out of adaptation training);

and reports, next to them, what the cut saves: the fraction of layer compute prompt tokens skip
(≈ the prefill FLOP saving, ignoring attention's quadratic part) and of prompt KV memory. The
recommended cut is the lowest one whose needle accuracy is not below the dense model's and whose
perplexity is within ``ppl_tolerance`` of it.

``adapted`` models (``vllm-accel speed-adapt`` outputs) are evaluated on the same cases at the
cut each was adapted for (read from its config), as a second curve next to the untuned one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_CUTS = (1.0, 0.875, 0.75, 0.625, 0.5)


@dataclass
class CalibrationPlan:
    cuts: tuple[float, ...] = DEFAULT_CUTS
    anchor_tokens: int = 1
    needle_length: int = 1024
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    needles_per_depth: int = 2
    multikey_length: int = 1024
    multikey_samples: int = 4
    ppl_documents: int = 2
    ppl_prompt_tokens: int = 768
    ppl_continuation_tokens: int = 128
    ppl_tolerance: float = 0.05
    code_samples: int = 4
    code_prompt_tokens: int = 512
    code_continuation_tokens: int = 64
    seed: int = 0


@dataclass
class CutResult:
    cut: float
    num_lower_layers: int
    needle_accuracy: float | None
    perplexity: float | None
    prompt_compute_saved: float  # fraction of decoder-layer work prompt tokens skip
    prompt_kv_saved: float  # fraction of prompt KV not stored
    multikey_accuracy: float | None = None
    answers: list[str] = field(default_factory=list)
    code_perplexity: float | None = None
    model: str = "untuned"  # or "adapted"


def _ppl_documents(tokenizer, plan: CalibrationPlan) -> list[tuple[list[int], list[int]]]:
    from vllm_accel.quality import data

    ids = tokenizer(data.heldout_text(), add_special_tokens=False)["input_ids"]
    span = plan.ppl_prompt_tokens + plan.ppl_continuation_tokens
    if span * plan.ppl_documents > len(ids):
        raise ValueError(f"held-out text has {len(ids)} tokens; {plan.ppl_documents}x{span} "
                         f"requested")
    docs = []
    for i in range(plan.ppl_documents):
        chunk = ids[i * span : (i + 1) * span]
        docs.append((chunk[: plan.ppl_prompt_tokens], chunk[plan.ppl_prompt_tokens :]))
    return docs


def build_code_documents(tokenizer, plan: CalibrationPlan) -> list[tuple[list[int], list[int]]]:
    """``plan.code_samples`` (prompt, continuation) windows of the evaluation split of the
    standard-library sources, one per file, from a seeded random offset."""
    import random

    from vllm_accel.speed.adapt.data import code_files

    rng = random.Random(plan.seed + 2)
    span = plan.code_prompt_tokens + plan.code_continuation_tokens
    docs = []
    for path in rng.sample(code_files("eval"), len(code_files("eval"))):
        if len(docs) == plan.code_samples:
            break
        ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"),
                        add_special_tokens=False)["input_ids"]
        if len(ids) >= span:
            start = rng.randrange(0, len(ids) - span + 1)
            docs.append((ids[start : start + plan.code_prompt_tokens],
                         ids[start + plan.code_prompt_tokens : start + span]))
    return docs


@dataclass
class _Tasks:
    needles: list
    keys: list
    docs: list
    code: list


def _evaluate(model, tokenizer, tasks: _Tasks, cut: float, plan: CalibrationPlan,
              label: str) -> CutResult:
    from vllm_accel.quality import needle, retrieval
    from vllm_accel.speed.config import SpeedConfig
    from vllm_accel.speed.reference import speed_continuation_logprobs, speed_greedy

    num_layers = len(model.model.layers)
    lower = SpeedConfig(cut=cut).num_lower_layers(num_layers)

    def answer(prompt_ids, tokens=12) -> str:
        return tokenizer.decode(speed_greedy(model, prompt_ids, tokens, cut, plan.anchor_tokens,
                                             eos_token_id=tokenizer.eos_token_id),
                                skip_special_tokens=True)

    def mean(scores: list[float]) -> float | None:
        return sum(scores) / len(scores) if scores else None

    def perplexity(docs) -> float | None:
        logprobs = [lp for prompt, cont in docs
                    for lp in speed_continuation_logprobs(model, prompt, cont, cut,
                                                          plan.anchor_tokens)]
        return math.exp(-sum(logprobs) / len(logprobs)) if logprobs else None

    answers = [answer(c.prompt_ids) for c in tasks.needles]
    accuracy = mean([needle.score(c, a) for c, a in zip(tasks.needles, answers)])
    multikey = mean([retrieval.score(c, answer(c.prompt_ids)) for c in tasks.keys])
    ppl, code = perplexity(tasks.docs), perplexity(tasks.code)
    skipped = (num_layers - lower) / num_layers
    return CutResult(cut, lower, accuracy, ppl, skipped, skipped, multikey, answers, code, label)


def _load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def calibrate(model_dir: str, plan: CalibrationPlan, adapted: tuple[str, ...] = (),
              log=print) -> dict[str, Any]:
    from vllm_accel.quality import needle, retrieval
    from vllm_accel.quality.prompts import load_tokenizer
    from vllm_accel.speed.config import adapted_knobs

    tokenizer = load_tokenizer(model_dir)
    tasks = _Tasks(
        needle.build_cases(tokenizer, [plan.needle_length], list(plan.needle_depths),
                           seed=plan.seed, needles_per_cell=plan.needles_per_depth),
        retrieval.build_multikey(tokenizer, [plan.multikey_length], plan.multikey_samples,
                                 seed=plan.seed + 1),
        _ppl_documents(tokenizer, plan), build_code_documents(tokenizer, plan))
    runs = [(model_dir, cut, "untuned") for cut in plan.cuts]
    for path in adapted:
        knobs = adapted_knobs(_load_config(path))
        if "cut" not in knobs:
            raise ValueError(f"--adapted {path}: not a SPEED-adapted model (no "
                             f"vllm_accel_speed in its config.json)")
        runs.append((path, knobs["cut"], "adapted"))
    results, loaded, num_layers = [], {}, 0
    for path, cut, label in runs:
        if path not in loaded:
            loaded.clear()  # one model in memory at a time
            loaded[path] = _load(path)
        model = loaded[path]
        num_layers = len(model.model.layers)
        r = _evaluate(model, tokenizer, tasks, cut, plan, label)
        results.append(r)
        if len(results) == 1:
            log(HEADER)
        log(_row(asdict(r)))
    untuned = [r for r in results if r.model == "untuned"]
    return {"model": model_dir, "num_layers": num_layers, "plan": asdict(plan),
            "adapted": list(adapted), "results": [asdict(r) for r in results],
            "recommended_cut": recommend(untuned, plan.ppl_tolerance)}


def _load_config(model_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def recommend(results: list[CutResult], ppl_tolerance: float) -> float | None:
    """The lowest cut that keeps the dense (deepest) cut's needle and multi-key accuracy and
    its perplexity within ``ppl_tolerance``; None when no cut was measured."""
    if not results:
        return None
    dense = max(results, key=lambda r: r.num_lower_layers)
    ok = [r for r in results if (r.needle_accuracy or 0.0) >= (dense.needle_accuracy or 0.0)
          and (r.multikey_accuracy or 0.0) >= (dense.multikey_accuracy or 0.0)
          and (r.perplexity is None or r.perplexity <= dense.perplexity * (1 + ppl_tolerance))]
    return min(ok, key=lambda r: r.num_lower_layers).cut if ok else dense.cut


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


HEADER = (f"{'weights':>8} {'cut':>6} {'lower':>6} {'needle':>7} {'multi-key':>10} "
          f"{'cont. ppl':>10} {'code ppl':>9} {'saved':>6}")


def _row(r: dict[str, Any]) -> str:
    return (f"{r.get('model', 'untuned'):>8} {r['cut']:>6} {r['num_lower_layers']:>6} "
            f"{_fmt(r['needle_accuracy']):>7} {_fmt(r.get('multikey_accuracy')):>10} "
            f"{_fmt(r['perplexity'], 3):>10} {_fmt(r.get('code_perplexity'), 3):>9} "
            f"{r['prompt_compute_saved']:>6.0%}")


def table(report: dict[str, Any]) -> str:
    lines = [f"SPEED calibration: {report['model']} ({report['num_layers']} layers)", HEADER]
    lines += [_row(r) for r in report["results"]]
    lines.append(f"recommended cut for the untuned weights: {report['recommended_cut']} (lowest "
                 f"cut keeping the dense needle and multi-key accuracy and perplexity within "
                 f"{report['plan']['ppl_tolerance']:.0%})")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> None:
    """Retrieval accuracy and perplexity / dense against the cut; untuned solid, adapted dashed,
    the dense model dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    dense = max((r for r in rows if r.get("model", "untuned") == "untuned"),
                key=lambda r: r["num_lower_layers"])
    fig, (acc, ppl) = plt.subplots(1, 2, figsize=(10, 4))
    panels = ((acc, "needle_accuracy", "needle", "o", "C0"),
              (acc, "multikey_accuracy", "multi-key", "d", "C1"),
              (ppl, "perplexity", "essay continuation", "s", "C3"),
              (ppl, "code_perplexity", "code continuation", "^", "C2"))
    for label, style in (("untuned", "-"), ("adapted", "--")):
        mine = sorted((r for r in rows if r.get("model", "untuned") == label),
                      key=lambda r: r["num_lower_layers"])
        cuts = [r["num_lower_layers"] / report["num_layers"] for r in mine]
        for ax, key, name, marker, color in panels:
            if not mine or dense.get(key) is None or any(r.get(key) is None for r in mine):
                continue
            scale = dense[key] if ax is ppl else 1.0
            ax.plot(cuts, [r[key] / scale for r in mine], marker + style, color=color,
                    label=f"{name}, {label}")
    for ax, key, _, _, color in panels:
        if ax is acc and dense.get(key) is not None:
            ax.axhline(dense[key], color=color, lw=0.8, ls=":")
    ppl.axhline(1.0, color="gray", lw=0.8, ls=":")
    acc.set_ylim(0, 1.05)
    acc.set_ylabel("retrieval accuracy (dotted: dense)")
    ppl.set_ylabel("perplexity / dense")
    for ax in (acc, ppl):
        ax.set_xlabel("fraction of layers that see prompt tokens (cut)")
        ax.legend(fontsize=8)
    fig.suptitle(f"SPEED on {report['model'].rstrip('/').split('/')[-1]}: untuned vs adapted")
    fig.tight_layout()
    fig.savefig(path)
