"""Which recomputed tokens make chunk reuse answer right? (development study, not a test)

Runs the ``bench chunk-reuse`` workload (:mod:`vllm_accel.bench.chunk_reuse_workload`) in one
in-process engine with ``ChunkReuseConnector`` and, for every measured question, answers it once
per *selection mode*, a mode being the set of reused tokens recomputed in every layer:

* ``all`` — every reused token (equals full recompute; the reference accuracy);
* ``none`` — nothing (naive reuse);
* ``query`` / ``query@R`` / ``query@R/wW`` — the connector's ``recompute=query`` choice at
  ``recompute_ratio`` R (default 0.15) and ``query_window`` W (default 4);
* ``query@R/wB:F`` — the same with ``B`` neighbours before each ranked token and ``F`` after;
* ``query@R/dN`` (also after ``/wW``) — ``query`` whose probe also drafts ``N`` answer tokens
  (``query_draft_tokens``);
* ``queryrr`` / ``queryrr@R`` — the ``query`` ranking dealt out across documents (each
  document's best token first, then each one's second best, ...);
* ``query2`` / ``query2@R`` — two rounds: half the budget chosen by the probe and recomputed,
  then a second probe over the refreshed pages chooses the other half;
* ``facts`` — oracle: the inserted fact sentence of every document (4 tokens before it, 16 from
  its start), nothing else;
* ``first`` — the first 16 tokens of every document (EPIC's choice);
* ``target`` / ``nontarget`` — oracle: the documents the answer needs / all the others;
* ``A+B`` — the union of modes ``A`` and ``B`` (e.g. ``query+facts``).

Usage (about 10 s per question and mode for Qwen2.5-Coder-0.5B on 2 cores)::

    python benchmarks/chunk_reuse_selection_study.py --modes all,none,query,facts \\
        --questions 16 --seed 0

At the end it prints each mode's right answers and its median time choosing the tokens (the
probe included; the modes run in the same engine, one after the other, so these compare).
``--coverage`` adds, per answer, how many of the first 16 tokens of each answer document's fact
sentence the mode recomputed.

The modes replace the connector's ``_query_choice`` (the engine runs with ``recompute=query``),
so every mode goes through the same load, re-rotation and recompute path.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process

from vllm_accel.bench import chunk_reuse_workload as workload  # noqa: E402
from vllm_accel.kv_connector import connector as connector_mod  # noqa: E402
from vllm_accel.kv_connector import planner  # noqa: E402
from vllm_accel.models.fetch import model_path  # noqa: E402

_STATE: dict = {}
#: A fact sentence's tokens from its start ("The access code of the X archive is NNNN."): what
#: the ``facts`` oracle recomputes (with 4 tokens before it) and ``--coverage`` counts.
_FACT_TOKENS = 16
_query_choice = connector_mod.ChunkReuseConnector._query_choice


def _choice(self, model, layers, block_table, req, forced, loaded):
    start = time.perf_counter()
    chosen = _mode_choice(self, model, layers, block_table, req, forced, loaded)
    _STATE["choice_seconds"].setdefault(_STATE["mode"], []).append(time.perf_counter() - start)
    _STATE["chosen"] = set(chosen)
    return chosen


def _mode_choice(self, model, layers, block_table, req, forced, loaded):
    mode, spans = _STATE["mode"], _STATE["spans"]
    if "+" in mode:  # the union of the parts' choices
        chosen = set()
        for part in mode.split("+"):
            _STATE["mode"] = part
            try:
                chosen |= set(_mode_choice(self, model, layers, block_table, req, forced,
                                           loaded))
            finally:
                _STATE["mode"] = mode
        return sorted(chosen)
    allowed = set(loaded)
    if mode.startswith("query"):
        name, _, setting = mode.partition("@")
        setting, _, draft = setting.partition("/d")
        _STATE["draft"] = int(draft or self.config.query_draft_tokens)
        ratio_text, _, window = setting.partition("/w")
        ratio = float(ratio_text or self.config.recompute_ratio)
        window, _, after = window.partition(":")
        window = int(window) if window else self.config.query_window
        if after:  # asymmetric window: the planner's ``after`` neighbours
            return _after_windows(self, model, layers, block_table, req, forced, loaded,
                                  ratio, window, int(after))
        if name == "queryrr":
            return _round_robin(self, model, layers, block_table, req, forced, loaded, ratio,
                                window)
        if name == "query2":
            return _two_rounds(self, model, layers, block_table, req, forced, loaded, ratio,
                               window)
        return _query_with(self, model, layers, block_table, req, forced, loaded, ratio,
                           window)
    chosen: set[int] = set()
    if mode == "all":
        chosen = allowed
    elif mode == "facts":
        for f in _STATE["facts"]:
            chosen |= set(range(f - 4, f + _FACT_TOKENS))
    elif mode == "first":
        for start, _ in spans:
            chosen |= set(range(start, start + 16))
    elif mode in ("target", "nontarget"):
        for j, (start, end) in enumerate(spans):
            if (j in _STATE["targets"]) == (mode == "target"):
                chosen |= set(range(start, end))
    elif mode != "none":
        raise SystemExit(f"unknown mode {mode!r}")
    return sorted(chosen & allowed)


def _query_with(self, model, layers, block_table, req, forced, loaded, ratio, window,
                windows=None):
    """The connector's ``query`` choice at ``ratio`` and ``window``; with ``windows``, that
    function stands in for the planner's ``windows_by_rank`` (same arguments)."""
    saved, self.config = self.config, dataclasses.replace(
        self.config, recompute_ratio=ratio, query_window=window,
        query_draft_tokens=_STATE["draft"])
    original = connector_mod.windows_by_rank
    connector_mod.windows_by_rank = windows or original
    try:
        return _query_choice(self, model, layers, block_table, req, forced, loaded)
    finally:
        self.config, connector_mod.windows_by_rank = saved, original


def _after_windows(self, model, layers, block_table, req, forced, loaded, ratio, before,
                   after):
    """``query@R/wB:F``: the ``query`` choice with ``B`` neighbours before each ranked token
    and ``F`` after it."""

    def asymmetric(ranked, allowed, budget, window):
        return planner.windows_by_rank(ranked, allowed, budget, before, after)

    return _query_with(self, model, layers, block_table, req, forced, loaded, ratio, before,
                       asymmetric)


def _round_robin(self, model, layers, block_table, req, forced, loaded, ratio, window):
    """``queryrr``: the ``query`` ranking dealt out across documents (every document's best
    token, then every document's second best, ...), so no document's reused KV is left
    entirely as loaded."""
    spans = _STATE["spans"]

    def by_document(ranked, allowed, budget, window):
        places = [[p for p in ranked if start <= p < end] for start, end in spans]
        dealt = [p for rank in zip(*places) for p in rank]
        taken = set(dealt)
        dealt += [p for p in ranked if p not in taken]  # past the shortest document's ranks
        return planner.windows_by_rank(dealt, allowed, budget, window)

    return _query_with(self, model, layers, block_table, req, forced, loaded, ratio, window,
                       by_document)


def _two_rounds(self, model, layers, block_table, req, forced, loaded, ratio, window):
    """``query2``: half the budget chosen by a probe and recomputed, then the other half chosen
    by a second probe over the refreshed pages (the connector recomputes that half)."""
    import torch

    from vllm_accel.kv_connector import blend

    first = _query_with(self, model, layers, block_table, req, forced, loaded, ratio / 2,
                        window)
    if not first:
        return first
    device = block_table.device
    blend.recompute_tokens(model, layers, block_table,
                           torch.tensor([req.token_ids[p] for p in first], device=device),
                           torch.tensor(first, dtype=torch.long, device=device))
    taken = set(first)
    rest = [p for p in loaded if p not in taken]
    second_ratio = min(1.0, ratio / 2 * len(loaded) / max(1, len(rest)))
    return _query_with(self, model, layers, block_table, req, forced, rest, second_ratio,
                       window)


def _digit_margin(tokenizer, output) -> float:
    """The smallest log-probability lead (nats) of a chosen digit token over the runner-up:
    how close the answer's closest digit decision was to flipping."""
    margins = [math.inf]
    for token, ranked in zip(output.token_ids, output.logprobs or []):
        if not tokenizer.decode([token]).strip().isdigit():
            continue
        others = [lp.logprob for t, lp in ranked.items() if t != token]
        if others:
            margins.append(ranked[token].logprob - max(others))
    return min(margins)


def _fact_coverage() -> str:
    """How much of each answer document's fact sentence (its first ``_FACT_TOKENS`` tokens: the
    name, then the code's digits) the mode recomputed, e.g. ``facts 9/16,16/16``."""
    chosen = _STATE["chosen"]
    return "facts " + ",".join(
        f"{len(chosen.intersection(range(f, f + _FACT_TOKENS)))}/{_FACT_TOKENS}"
        for f in (_STATE["facts"][j] for j in _STATE["targets"]))


def _fact_offset(tokenizer, ids: list[int]) -> int:
    for k in range(len(ids)):
        if tokenizer.decode(ids[k:k + 6]).strip().startswith("The access code"):
            return k
    raise ValueError("no fact sentence in the document")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--modes", default="all,none,query,facts")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--coverage", action="store_true",
                        help="print how much of each answer document's fact sentence every "
                             "mode recomputed")
    args = parser.parse_args()
    modes = args.modes.split(",")

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    connector_mod.ChunkReuseConnector._query_choice = _choice
    model_dir = str(model_path(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    work = workload.build(tokenizer, [8], 512, args.questions, max(1, args.questions // 4),
                          seed=args.seed)
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True,
              max_model_len=work.max_prompt_tokens + 64, enable_prefix_caching=False,
              gpu_memory_utilization=args.gpu_memory_utilization,
              kv_transfer_config={
                  "kv_connector": "ChunkReuseConnector",
                  "kv_connector_module_path": "vllm_accel.kv_connector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"recompute": "query", "log_interval_s": 600}})
    _STATE.update(mode="none", spans=[], facts=[], targets=[], choice_seconds={})
    for prompt in work.warmup:  # fills the store
        llm.generate([{"prompt_token_ids": list(prompt)}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
    _STATE["choice_seconds"].clear()
    facts = [_fact_offset(tokenizer, list(d.token_ids)) for d in work.documents]
    greedy = SamplingParams(max_tokens=16, temperature=0, logprobs=2)
    right = dict.fromkeys(modes, 0)
    for q in work.questions:
        prompt = list(q.prompt)
        seps = [i for i, t in enumerate(prompt) if t == work.separator_id]
        spans = [(seps[j], seps[j + 1]) for j in range(len(q.order))]
        _STATE.update(spans=spans, facts=[seps[j] + 1 + facts[d] for j, d in enumerate(q.order)],
                      targets=[q.order.index(t) for t in q.targets])
        line = []
        for mode in modes:
            _STATE.update(mode=mode, chosen=set())
            output = llm.generate([{"prompt_token_ids": prompt}], greedy,
                                  use_tqdm=False)[0].outputs[0]
            ok = workload.score(q.expected, output.text)
            right[mode] += ok
            line.append(f"{mode}:{'Y' if ok else 'n'} {output.text.strip()[:14]!r} "
                        f"m={_digit_margin(tokenizer, output):.2f}"
                        + (f" {_fact_coverage()}" if args.coverage else ""))
        print(f"{q.expected} at {_STATE['targets']}: " + "  ".join(line), flush=True)
    print("right answers of", len(work.questions), right)
    print("median seconds choosing (probe included), per request:",
          {mode: round(statistics.median(_STATE["choice_seconds"].get(mode, [0.0])), 3)
           for mode in modes})


if __name__ == "__main__":
    main()
