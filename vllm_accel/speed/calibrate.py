"""``vllm-accel calibrate speed``: the quality/savings curve of SPEED's cut on a real model.

Off-the-shelf weights were not trained for SPEED, so how deep prompt tokens must go is a
property of the model. This sweep runs the PyTorch oracle (:mod:`.reference`: the exact policy,
with real compute skip) on a small calibration set, for each cut:

* **needle**: a fact hidden at several depths of essay text, greedy answer checked;
* **multi-key retrieval**: four key/value facts in essay text, the value of one asked for;
* **continuation perplexity**: essays split into a prompt and a continuation; the continuation
  is scored token by token as decode tokens (full depth), after a SPEED prefill of the prompt
  (the quantity SPEED changes: how well decoding sees a prompt it only read shallowly);

and reports, next to them, what the cut saves: the fraction of layer compute prompt tokens skip
(≈ the prefill FLOP saving, ignoring attention's quadratic part) and of prompt KV memory. The
recommended cut is the lowest one whose needle accuracy is not below the dense model's and whose
perplexity is within ``ppl_tolerance`` of it.
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


def calibrate(model_dir: str, plan: CalibrationPlan, log=print) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_accel.quality import needle, retrieval
    from vllm_accel.quality.prompts import load_tokenizer
    from vllm_accel.speed.config import SpeedConfig
    from vllm_accel.speed.reference import speed_continuation_logprobs, speed_greedy

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    num_layers = len(model.model.layers)
    cases = needle.build_cases(tokenizer, [plan.needle_length], list(plan.needle_depths),
                               seed=plan.seed, needles_per_cell=plan.needles_per_depth)
    keys = retrieval.build_multikey(tokenizer, [plan.multikey_length], plan.multikey_samples,
                                    seed=plan.seed + 1)
    docs = _ppl_documents(tokenizer, plan)
    results = []
    for cut in plan.cuts:
        lower = SpeedConfig(cut=cut).num_lower_layers(num_layers)

        def answer(case, cut=cut) -> str:
            return tokenizer.decode(speed_greedy(model, case.prompt_ids, 12, cut,
                                                 plan.anchor_tokens,
                                                 eos_token_id=tokenizer.eos_token_id),
                                    skip_special_tokens=True)

        answers = [answer(c) for c in cases]
        accuracy = sum(needle.score(c, a) for c, a in zip(cases, answers)) / len(cases)
        multikey = sum(retrieval.score(c, answer(c)) for c in keys) / len(keys)
        logprobs = [lp for prompt, cont in docs
                    for lp in speed_continuation_logprobs(model, prompt, cont, cut,
                                                          plan.anchor_tokens)]
        ppl = math.exp(-sum(logprobs) / len(logprobs))
        skipped = (num_layers - lower) / num_layers
        results.append(CutResult(cut, lower, accuracy, ppl, skipped, skipped, multikey,
                                 answers))
        log(f"cut {cut:<6} ({lower:>2}/{num_layers} layers): needle {accuracy:.2f}  "
            f"multi-key {multikey:.2f}  continuation ppl {ppl:.3f}  "
            f"prompt compute/KV saved {skipped:.0%}")
    return {"model": model_dir, "num_layers": num_layers, "plan": asdict(plan),
            "results": [asdict(r) for r in results],
            "recommended_cut": recommend(results, plan.ppl_tolerance)}


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


def table(report: dict[str, Any]) -> str:
    lines = [f"SPEED calibration: {report['model']} ({report['num_layers']} layers)",
             f"{'cut':>6} {'lower':>6} {'needle':>7} {'multi-key':>10} {'cont. ppl':>10} "
             f"{'saved':>6}"]
    for r in report["results"]:
        multikey = r.get("multikey_accuracy")
        lines.append(f"{r['cut']:>6} {r['num_lower_layers']:>6} {r['needle_accuracy']:>7.2f} "
                     f"{'-' if multikey is None else f'{multikey:.2f}':>10} "
                     f"{r['perplexity']:>10.3f} {r['prompt_compute_saved']:>6.0%}")
    lines.append(f"recommended cut: {report['recommended_cut']} (lowest cut keeping the dense "
                 f"needle and multi-key accuracy and perplexity within "
                 f"{report['plan']['ppl_tolerance']:.0%})")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    cuts = [r["num_lower_layers"] / report["num_layers"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(cuts, [r["needle_accuracy"] for r in rows], "o-", label="needle accuracy")
    if all(r.get("multikey_accuracy") is not None for r in rows):
        ax.plot(cuts, [r["multikey_accuracy"] for r in rows], "d-",
                label="multi-key accuracy")
    dense_ppl = max(rows, key=lambda r: r["num_lower_layers"])["perplexity"]
    ax.plot(cuts, [dense_ppl / r["perplexity"] for r in rows], "s-",
            label="dense ppl / ppl (1 = no loss)")
    ax.plot(cuts, [r["prompt_compute_saved"] for r in rows], "^--",
            label="prompt compute & KV saved")
    ax.set_xlabel("fraction of layers that see prompt tokens (cut)")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower left")
    ax.set_title(f"SPEED on {report['model'].rstrip('/').split('/')[-1]} (untuned weights)")
    fig.tight_layout()
    fig.savefig(path)
