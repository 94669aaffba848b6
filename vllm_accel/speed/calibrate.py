"""``vllm-accel calibrate speed``: the quality/savings curve of SPEED's cut on a real model.

Off-the-shelf weights were not trained for SPEED, so how deep prompt tokens must go is a
property of the model. This sweep runs the PyTorch oracle (:mod:`.reference`: the exact policy,
with real compute skip) on a small calibration set, for each cut:

* **needle**: a fact hidden at several depths of essay text, greedy answer checked;
* **multi-key retrieval**: four key/value facts in essay text, the value of one asked for;
* **continuation perplexity**: essays split into a prompt and a continuation; the continuation
  is scored token by token as decode tokens (full depth), after a SPEED prefill of the prompt
  (the quantity SPEED changes: how well decoding sees a prompt it only read shallowly);
* **code**: next-line completion in Python standard-library files (the split
  :func:`vllm_accel.speed.adapt.data.code_files` keeps out of adaptation training): the greedy
  line must equal the file's next line;

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
    code_samples: int = 8
    code_prompt_tokens: int = 512
    seed: int = 0


@dataclass
class CutResult:
    cut: float
    num_lower_layers: int
    needle_accuracy: float
    perplexity: float
    prompt_compute_saved: float  # fraction of decoder-layer work prompt tokens skip
    prompt_kv_saved: float  # fraction of prompt KV not stored
    multikey_accuracy: float | None = None
    answers: list[str] = field(default_factory=list)
    code_accuracy: float | None = None
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


@dataclass(frozen=True)
class CodeCase:
    prompt_ids: list[int]
    answer: str  # the file's next line, stripped


def build_code_cases(tokenizer, plan: CalibrationPlan) -> list[CodeCase]:
    """``plan.code_samples`` next-line cases from the evaluation split of stdlib sources."""
    import random

    from vllm_accel.speed.adapt.data import code_files

    rng = random.Random(plan.seed + 2)
    files = code_files("eval")
    cases: list[CodeCase] = []
    while len(cases) < plan.code_samples and files:
        lines = rng.choice(files).read_text(encoding="utf-8", errors="replace").splitlines()
        k = rng.randrange(len(lines) // 2, len(lines))
        if len(lines[k].strip()) < 12:  # blank lines, lone brackets: too easy
            continue
        ids = tokenizer("\n".join(lines[:k]) + "\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= plan.code_prompt_tokens:
            cases.append(CodeCase(ids[-plan.code_prompt_tokens:], lines[k].strip()))
    return cases


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

    answers = [answer(c.prompt_ids) for c in tasks.needles]
    accuracy = sum(needle.score(c, a) for c, a in zip(tasks.needles, answers)) / len(answers)
    multikey = sum(retrieval.score(c, answer(c.prompt_ids)) for c in tasks.keys) / max(
        1, len(tasks.keys))
    logprobs = [lp for prompt, cont in tasks.docs
                for lp in speed_continuation_logprobs(model, prompt, cont, cut,
                                                      plan.anchor_tokens)]
    ppl = math.exp(-sum(logprobs) / len(logprobs))
    code = (sum(answer(c.prompt_ids, 32).split("\n")[0].strip() == c.answer
                for c in tasks.code) / len(tasks.code)) if tasks.code else None
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
        _ppl_documents(tokenizer, plan), build_code_cases(tokenizer, plan))
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
        code = "-" if r.code_accuracy is None else f"{r.code_accuracy:.2f}"
        log(f"{label:>8} cut {cut:<6} ({r.num_lower_layers:>2}/{num_layers} "
            f"layers): needle {r.needle_accuracy:.2f}  multi-key {r.multikey_accuracy:.2f}  "
            f"code {code}  continuation ppl {r.perplexity:.3f}  "
            f"prompt compute/KV saved {r.prompt_compute_saved:.0%}")
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
    ok = [r for r in results if r.needle_accuracy >= dense.needle_accuracy
          and (r.multikey_accuracy or 0.0) >= (dense.multikey_accuracy or 0.0)
          and r.perplexity <= dense.perplexity * (1 + ppl_tolerance)]
    return min(ok, key=lambda r: r.num_lower_layers).cut if ok else dense.cut


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(report: dict[str, Any]) -> str:
    lines = [f"SPEED calibration: {report['model']} ({report['num_layers']} layers)",
             f"{'weights':>8} {'cut':>6} {'lower':>6} {'needle':>7} {'multi-key':>10} "
             f"{'code':>6} {'cont. ppl':>10} {'saved':>6}"]
    for r in report["results"]:
        lines.append(f"{r.get('model', 'untuned'):>8} {r['cut']:>6} {r['num_lower_layers']:>6} "
                     f"{r['needle_accuracy']:>7.2f} {_fmt(r.get('multikey_accuracy')):>10} "
                     f"{_fmt(r.get('code_accuracy')):>6} {r['perplexity']:>10.3f} "
                     f"{r['prompt_compute_saved']:>6.0%}")
    lines.append(f"recommended cut for the untuned weights: {report['recommended_cut']} (lowest "
                 f"cut keeping the dense needle and multi-key accuracy and perplexity within "
                 f"{report['plan']['ppl_tolerance']:.0%})")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> None:
    """Retrieval accuracy and perplexity ratio against the cut; untuned solid, adapted dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    dense_ppl = max(rows, key=lambda r: r["num_lower_layers"])["perplexity"]
    fig, (acc, ppl) = plt.subplots(1, 2, figsize=(10, 4))
    tasks = (("needle_accuracy", "needle", "o", "C0"),
             ("multikey_accuracy", "multi-key", "d", "C1"),
             ("code_accuracy", "code next line", "^", "C2"))
    dense = max(rows, key=lambda r: r["num_lower_layers"])
    for key, _, _, color in tasks:
        if dense.get(key) is not None:
            acc.axhline(dense[key], color=color, lw=0.8, ls=":")
    for label, style in (("untuned", "-"), ("adapted", "--")):
        mine = sorted((r for r in rows if r.get("model", "untuned") == label),
                      key=lambda r: r["num_lower_layers"])
        if not mine:
            continue
        cuts = [r["num_lower_layers"] / report["num_layers"] for r in mine]
        for key, name, marker, color in tasks:
            if all(r.get(key) is not None for r in mine):
                acc.plot(cuts, [r[key] for r in mine], marker + style, color=color,
                         label=f"{name}, {label}")
        ppl.plot(cuts, [r["perplexity"] / dense_ppl for r in mine], "s" + style, color="C3",
                 label=label)
    acc.set_ylim(0, 1.05)
    acc.set_ylabel("accuracy (dotted: dense)")
    ppl.axhline(1.0, color="gray", lw=0.8)
    ppl.set_ylabel("continuation perplexity / dense")
    for ax in (acc, ppl):
        ax.set_xlabel("fraction of layers that see prompt tokens (cut)")
        ax.legend(fontsize=8)
    fig.suptitle(f"SPEED on {report['model'].rstrip('/').split('/')[-1]}: untuned vs adapted")
    fig.tight_layout()
    fig.savefig(path)
