"""Quality of the KIVI KV-cache dtypes inside real vLLM CPU engines (auto vs kivi_4bit/2bit).

Each configuration runs in its own engine process (``vllm_accel.bench.engine_worker``, the same
worker the bench harness uses), one at a time, on the same held-out windows
(``vllm_accel.quality.perplexity.build_windows``); perplexity is ``exp(-mean log p)`` over all
predicted prompt tokens (vLLM ``prompt_logprobs``). Next to it, against the first dtype listed
(``auto``): top-1 agreement and mean |delta log p| per prompt token
(``perplexity.prediction_agreement``) -- perplexity alone can fall under a lossy cache on text
the model predicts badly (see docs/kv_quant.md).

    flock /tmp/cpu.lock .venv/bin/python benchmarks/kivi_quality.py \
        --model ~/.cache/vllm-accel/models/qwen2.5-coder-0.5b-instruct \
        --window 1024 --count 2 --dtypes auto,kivi_4bit,kivi_2bit

Prompt log-probs read the KIVI cache the way decode steps read it: the KIVI engines run with
``kv_quant.prefill_kv = cache`` (``--prefill-kv``; under ``exact``, the CPU default, a window
prefilled in one step attends to its own unquantized K/V and scores as the unquantized cache).

Options: ``--max-num-batched-tokens`` (force chunked prefill), ``--json OUT`` (results with
every window's per-token log-probs and top-1 tokens),
``--dtype`` (model dtype, default bfloat16), ``--floor-chunk N`` (one more ``auto`` engine whose
prefill runs in chunks of N tokens: its agreement with the first ``auto`` engine is the engine's
own noise floor -- same weights, same cache format, only bf16 rounding of other kernel shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_accel.kv_quant.config import PREFILL_KV


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--count", type=int, default=2)
    ap.add_argument("--dtypes", default="auto,kivi_4bit,kivi_2bit")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--floor-chunk", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16",
                    help="model dtype (float32 avoids bf16 emulation on CPUs without AVX512-BF16)")
    ap.add_argument("--prefill-kv", default="cache", choices=PREFILL_KV,
                    help="the KIVI engines' kv_quant.prefill_kv (cache: as decode reads)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from vllm_accel.quality.perplexity import build_windows, perplexity, prediction_agreement

    model = os.path.expanduser(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    windows = build_windows(tok, args.window, args.count)
    results, per_window, logprobs, predictions = {}, {}, {}, {}
    configs = [(dt, dt, args.max_num_batched_tokens) for dt in args.dtypes.split(",")]
    if args.floor_chunk:
        configs.append((f"auto@chunk{args.floor_chunk}", "auto", args.floor_chunk))
    for dt, cache_dtype, batched_tokens in configs:
        engine = dict(model=model, dtype=args.dtype, kv_cache_dtype=cache_dtype,
                      max_model_len=args.window + 64, seed=0,
                      gpu_memory_utilization=args.gpu_memory_utilization)
        if cache_dtype.startswith("kivi"):
            engine["additional_config"] = {
                "vllm_accel": {"kv_quant": {"prefill_kv": args.prefill_kv}}}
        if batched_tokens:
            engine["max_num_batched_tokens"] = batched_tokens
            engine["enable_chunked_prefill"] = True
        spec = {"engine": engine,
                "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
                "tasks": [{"kind": "prompt_predictions", "name": "ppl", "prompts": windows}]}
        with tempfile.TemporaryDirectory() as td:
            sp, op = Path(td, "spec.json"), Path(td, "out.json")
            sp.write_text(json.dumps(spec))
            t0 = time.perf_counter()
            env = dict(os.environ, **spec["env"])
            r = subprocess.run([sys.executable, "-m", "vllm_accel.bench.engine_worker",
                                str(sp), str(op)], env=env, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stdout[-3000:], r.stderr[-6000:], file=sys.stderr)
                raise SystemExit(f"engine for {dt} failed")
            out = json.loads(op.read_text())
        predictions[dt] = out["tasks"]["ppl"]
        logprobs[dt] = [w["logprobs"] for w in predictions[dt]]
        ppl = perplexity(logprobs[dt])
        results[dt] = ppl
        per_window[dt] = [perplexity([w]) for w in logprobs[dt]]
        print(json.dumps({"kv_cache_dtype": dt, "ppl": ppl, "windows": args.count,
                          "window": args.window, "wall_s": round(time.perf_counter() - t0, 1)}),
              flush=True)
    first = next(iter(results))
    base = results[first]
    agreement = {dt: prediction_agreement(predictions[first], predictions[dt])
                 for dt in results if dt != first}
    print(f"\nmodel {Path(model).name}, {args.count} x {args.window} tokens, vs {first}")
    for dt, p in results.items():
        rel = f"{100 * (p / base - 1):+.2f} %"
        agree = agreement.get(dt)
        extra = (f"top-1 agree {100 * agree['top1_agreement']:5.1f} %  "
                 f"|dlogp| {agree['mean_abs_logprob_delta']:.3f}") if agree else ""
        wins = " ".join(f"{x:.2f}" for x in per_window[dt])
        print(f"  {dt:14s} ppl {p:8.4f}  {rel:>9s}  {extra:34s} per window: {wins}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "window": args.window,
                                               "count": args.count, "ppl": results,
                                               "ppl_per_window": per_window,
                                               "agreement_vs_" + first: agreement,
                                               "predictions": predictions}))


if __name__ == "__main__":
    main()
