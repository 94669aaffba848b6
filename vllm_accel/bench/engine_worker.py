"""Run one vLLM engine configuration over a list of tasks, in its own process.

``python -m vllm_accel.bench.engine_worker SPEC.json OUT.json``

The harness starts one of these per side (baseline, feature) so that the two engines never
share memory or threads, and a crash on one side is reported instead of killing the run.
Prompts arrive as token ids, so both sides see byte-identical inputs.

Task kinds (``spec["tasks"]``, run in order after one warm-up request):

* ``latency``     — each prompt alone: TTFT (submit → first token), TPOT (mean gap between
                    later tokens), the request's peak KV-cache blocks.
* ``throughput``  — all prompts submitted at once: output tokens/s, total wall time.
* ``generate``    — greedy; all prompts at once, or one at a time with ``"sequential": true``
                    (identity checks); returns token ids, text and prompt tokens served from
                    the prefix cache; with ``"logprobs": k`` also each output position's top-k
                    ``{token id: log-probability}`` (how close a tie was).
* ``prompt_predictions`` — per prompt ``{"logprobs": [...], "top1": [...]}``: the log-probability
                    of each prompt token (perplexity) and the engine's most likely token at
                    that position (agreement with another configuration's predictions).

Worker statistics: with ``spec["stats_file"]`` (a file an accelerated backend appends one JSON
line per engine step to, e.g. the ``sparse_prefill.stats_path`` knob), each latency record gets
the lines written while its request ran (``worker_stats``): the backend's own attention time
and density, measured inside the worker process.

Timing uses the engine's own step loop (``LLMEngine.step``) and ``time.perf_counter`` in this
process, identically for every configuration.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

_PEAK: dict[str, float] = {"kv_usage": 0.0}
# Speculative-decoding totals since the engine started (SchedulerStats.spec_decoding_stats).
_SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_SPEC: dict[str, int] = dict.fromkeys(_SPEC_KEYS, 0)
# Scheduler counters since the engine started (preempted requests, prefix-cache hit tokens),
# and the most requests running at once since the last task began.
_EVENT_KEYS = ("preemptions", "prefix_cache_hit_tokens")
_EVENTS: dict[str, int] = dict.fromkeys((*_EVENT_KEYS, "max_running_reqs"), 0)


def _stat_logger_factory():
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PeakKVUsage(StatLoggerBase):
        """Records the highest KV-cache usage the scheduler reports between resets, and
        totals speculative-decoding drafts and accepted tokens, preemptions and prefix-cache
        hits."""

        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                _PEAK["kv_usage"] = max(_PEAK["kv_usage"], scheduler_stats.kv_cache_usage)
                spec = scheduler_stats.spec_decoding_stats
                if spec is not None:
                    for key in _SPEC_KEYS:
                        _SPEC[key] += getattr(spec, key)
                _EVENTS["max_running_reqs"] = max(_EVENTS["max_running_reqs"],
                                                  scheduler_stats.num_running_reqs)
                prefix = scheduler_stats.prefix_cache_stats
                if prefix is not None:
                    _EVENTS["prefix_cache_hit_tokens"] += prefix.hits
            if iteration_stats is not None:
                _EVENTS["preemptions"] += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self):
            pass

    return PeakKVUsage


def _run(engine, prompts: list[list[int]], params) -> tuple[dict[str, dict[str, Any]], float]:
    """Submit ``prompts`` together; return per-request records and the wall time."""
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    records: dict[str, dict[str, Any]] = {}
    for i, ids in enumerate(prompts):
        rid = f"req-{i}"
        # a prompt is token ids, or TokensPrompt fields (e.g. with a cache_salt)
        prompt = TokensPrompt(**ids) if isinstance(ids, dict) else TokensPrompt(
            prompt_token_ids=ids)
        engine.add_request(rid, prompt, params)
        records[rid] = {"submit": time.perf_counter(), "token_times": [], "index": i}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            rec = records[out.request_id]
            completion = out.outputs[0]
            new = len(completion.token_ids) - len(rec["token_times"])
            rec["token_times"] += [now] * max(new, 0)
            if out.finished:
                rec["token_ids"] = list(completion.token_ids)
                rec["text"] = completion.text
                rec["num_cached_tokens"] = getattr(out, "num_cached_tokens", None)
                if completion.logprobs is not None:
                    rec["logprobs"] = [{str(tok): lp.logprob for tok, lp in entry.items()}
                                       for entry in completion.logprobs]
                if out.prompt_logprobs is not None:
                    rec["prompt_logprobs"] = [
                        None if entry is None else entry[tok].logprob
                        for tok, entry in zip(prompts[rec["index"]], out.prompt_logprobs)
                    ]
                    rec["prompt_top1"] = [
                        None if entry is None else
                        next((t for t, lp in entry.items() if lp.rank == 1), None)
                        for entry in out.prompt_logprobs
                    ]
    return records, time.perf_counter() - start


class _StatsTail:
    """The JSON lines appended to a worker statistics file since the last read."""

    def __init__(self, path: str | None):
        self.path, self.offset = path, 0

    def skip(self) -> None:
        if self.path and os.path.exists(self.path):
            self.offset = os.path.getsize(self.path)

    def read_new(self) -> list[dict[str, Any]] | None:
        if not self.path:
            return None
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            text = f.read()
        self.offset += len(text.encode())
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def _latency(engine, prompts, max_tokens, num_blocks,
             stats: _StatsTail | None = None) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stats = stats or _StatsTail(None)
    results = []
    for ids in prompts:
        _PEAK["kv_usage"] = 0.0
        stats.skip()
        records, _ = _run(engine, [ids], params)
        rec = records["req-0"]
        times = rec["token_times"]
        results.append({
            "prompt_tokens": len(ids),
            "output_tokens": len(times),
            "ttft_s": times[0] - rec["submit"],
            "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            "kv_blocks": round(_PEAK["kv_usage"] * num_blocks),
            "kv_usage": _PEAK["kv_usage"],  # peak fraction of the KV cache (all groups)
            "token_ids": rec["token_ids"],
        })
        worker_stats = stats.read_new()
        if worker_stats is not None:
            results[-1]["worker_stats"] = worker_stats
    return results


def _throughput(engine, prompts, max_tokens) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    _PEAK["kv_usage"] = 0.0
    records, wall = _run(engine, prompts, params)
    out_tokens = sum(len(r["token_times"]) for r in records.values())
    return {"requests": len(prompts), "output_tokens": out_tokens, "wall_s": wall,
            "output_tok_per_s": out_tokens / wall, "peak_kv_usage": _PEAK["kv_usage"]}


def _generate(engine, prompts, max_tokens, sequential: bool, ignore_eos: bool = False,
              logprobs: int | None = None) -> list[dict[str, Any]]:
    """Greedy generation. ``sequential`` runs each prompt alone: a batch's composition depends
    on arrival timing and changes bf16 rounding, so token-identity checks run one at a time or
    with the engine core in this process (``run_side(deterministic_batches=True)``).
    ``ignore_eos``: always ``max_tokens`` tokens (comparisons against an oracle)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                            logprobs=logprobs)
    batches = [[p] for p in prompts] if sequential else [prompts]
    outputs = []
    for batch in batches:
        records, _ = _run(engine, batch, params)
        outputs += [{key: records[f"req-{i}"][key] for key in
                     ("token_ids", "text", "num_cached_tokens", "logprobs")
                     if key in records[f"req-{i}"]} for i in range(len(batch))]
    return outputs


def _prompt_predictions(engine, prompts) -> list[dict[str, list]]:
    from vllm import SamplingParams

    # prompt_logprobs=1: each position also carries the engine's most likely token (rank 1)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    records, _ = _run(engine, prompts, params)
    return [{"logprobs": records[f"req-{i}"]["prompt_logprobs"],
             "top1": records[f"req-{i}"]["prompt_top1"]} for i in range(len(prompts))]


def _platform_info() -> dict[str, Any]:
    import platform

    import torch
    from vllm.platforms import current_platform

    info = {"device": current_platform.device_type, "machine": platform.machine(),
            "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "python": platform.python_version()}
    if current_platform.is_cuda_alike():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine_args = EngineArgs(**spec["engine"], disable_log_stats=False)
    engine = LLMEngine.from_engine_args(engine_args, stat_loggers=[_stat_logger_factory()])
    cache = engine.vllm_config.cache_config
    result: dict[str, Any] = {
        "vllm_version": vllm.__version__,
        "platform": _platform_info(),
        "load_s": time.perf_counter() - t0,
        "num_kv_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "tasks": {},
        # Speculative decoding per task and in total (zeros without speculation).
        "spec_decoding": {"by_task": {}},
        # Per task: preemptions, prefix-cache hit tokens, most requests running at once.
        "events": {},
    }
    first = spec["tasks"][0]["prompts"][0] if spec["tasks"] else [1, 2, 3]
    warmup = (first["prompt_token_ids"] if isinstance(first, dict) else first)[:32]
    _run(engine, [warmup], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for task in spec["tasks"]:
        kind, name = task["kind"], task["name"]
        spec_before, events_before = dict(_SPEC), dict(_EVENTS)
        _EVENTS["max_running_reqs"] = 0
        if kind == "latency":
            out = _latency(engine, task["prompts"], task["max_tokens"], cache.num_gpu_blocks,
                           _StatsTail(spec.get("stats_file")))
        elif kind == "throughput":
            out = _throughput(engine, task["prompts"], task["max_tokens"])
        elif kind == "generate":
            out = _generate(engine, task["prompts"], task["max_tokens"],
                            task.get("sequential", False), task.get("ignore_eos", False),
                            task.get("logprobs"))
        elif kind == "prompt_predictions":
            out = _prompt_predictions(engine, task["prompts"])
        else:
            raise ValueError(f"unknown task kind {kind!r}")
        result["tasks"][name] = out
        result["spec_decoding"]["by_task"][name] = {k: _SPEC[k] - spec_before[k]
                                                    for k in _SPEC_KEYS}
        result["events"][name] = {**{k: _EVENTS[k] - events_before[k] for k in _EVENT_KEYS},
                                  "max_running_reqs": _EVENTS["max_running_reqs"]}
    result["spec_decoding"]["total"] = dict(_SPEC)
    return result


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    for key, value in spec.get("env", {}).items():
        os.environ[key] = value
    result = run_spec(spec)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
