"""Token-id workloads for one benchmark plan: speed tasks and quality tasks."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from vllm_accel.bench.features import BenchPlan
from vllm_accel.quality import needle, perplexity, retrieval
from vllm_accel.quality.prompts import chat_ids, haystack


@dataclass
class Workloads:
    tasks: list[dict[str, Any]]
    needle_cases: list[needle.NeedleCase]
    retrieval_cases: list[retrieval.RetrievalCase]
    max_model_len: int


def _summary_prompt(tokenizer, num_tokens: int, rng: random.Random) -> list[int]:
    text = haystack(tokenizer, max(num_tokens - 40, 16), rng)
    return chat_ids(tokenizer, text + "\n\nSummarise the text above in three sentences.")


def build(tokenizer, plan: BenchPlan, seed: int = 0) -> Workloads:
    rng = random.Random(seed)
    latency = [_summary_prompt(tokenizer, n, rng)
               for n in plan.prompt_lengths for _ in range(plan.repetitions)]
    throughput = [_summary_prompt(tokenizer, plan.throughput_prompt_tokens, rng)
                  for _ in range(plan.throughput_requests)]
    identity = [_summary_prompt(tokenizer, rng.choice((64, 128, 256, 512)), rng)
                for _ in range(plan.identity_prompts)]
    needles = needle.build_cases(tokenizer, list(plan.needle_lengths), list(plan.needle_depths),
                                 seed=seed)
    retrievals = []
    if "multikey" in plan.retrieval_kinds:
        retrievals += retrieval.build_multikey(tokenizer, list(plan.retrieval_lengths),
                                               plan.retrieval_samples)
    if "multivalue" in plan.retrieval_kinds:
        retrievals += retrieval.build_multivalue(tokenizer, list(plan.retrieval_lengths),
                                                 plan.retrieval_samples)
    windows = perplexity.build_windows(tokenizer, plan.ppl_window_tokens, plan.ppl_windows)
    tasks = [
        {"kind": "latency", "name": "latency", "prompts": latency,
         "max_tokens": plan.output_tokens},
        {"kind": "throughput", "name": "throughput", "prompts": throughput,
         "max_tokens": plan.throughput_output_tokens},
        {"kind": "generate", "name": "identity", "prompts": identity,
         "max_tokens": plan.identity_output_tokens, "sequential": True},
        {"kind": "generate", "name": "needle", "prompts": [c.prompt_ids for c in needles],
         "max_tokens": 24},
        {"kind": "generate", "name": "retrieval", "prompts": [c.prompt_ids for c in retrievals],
         "max_tokens": 40},
        {"kind": "prompt_predictions", "name": "perplexity", "prompts": windows},
    ]
    tasks = [t for t in tasks if t["name"] in plan.tasks and t["prompts"]]
    if "needle" not in plan.tasks:
        needles = []
    if "retrieval" not in plan.tasks:
        retrievals = []
    longest = max(len(p) + t.get("max_tokens", 1) for t in tasks for p in t["prompts"])
    return Workloads(tasks, needles, retrievals, max_model_len=longest + 16)
