"""GPU kernel benchmark: block-sparse prefill attention vs dense SDPA (one layer, one sequence).

Needs only torch + triton (no vLLM, no install)::

    PYTHONPATH=. python benchmarks/gpu/bench_sparse_prefill.py --quick --json results/sparse.json

For each prompt length (default 32K/64K/128K; Llama-8B-like 32 query / 8 KV heads, head_dim
128, bf16, causal) it times, on the same inputs:

* dense ``scaled_dot_product_attention`` with the cuDNN and the flash backends (K/V expanded to
  the query heads beforehand, outside the timing);
* our Triton kernel with every causal block selected (density 1.0: kernel efficiency vs dense);
* the sparse pipeline at ``--density`` (default 10 %): block scoring + selection
  (``select_blocks_contiguous``, antidiagonal and mean-pooled estimators) **plus** the kernel,
  and each part alone, for each query/key tiling in ``--configs``.

TFLOP/s are counted on the work done: dense = ``4 * N^2 / 2 * D * Hq``; ours = ``4 * BQ * BK
* D`` per computed (query block, key block, query head). Speed-ups are vs the dense backends at
the same length (best tiling/estimator). Correctness is checked at a small length first
(density 1.0 vs SDPA, sparse vs the dense masked reference). ``--quick`` keeps the whole run
under ~3 minutes on an H200 (2 tilings, 3 repetitions); a failing configuration is reported
and skipped.

``--dry-run`` runs the same code at tiny sizes on the CPU with the Triton interpreter, to test
the script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions and configurations")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes on the CPU under TRITON_INTERPRET=1 (tests the script)")
    p.add_argument("--json", default=None, help="write results as JSON to this path")
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--methods", default="antidiagonal,mean_pool",
                   help="scoring methods to time (comma-separated: antidiagonal, mean_pool)")
    p.add_argument("--stride", type=int, default=16)
    p.add_argument("--configs", default=None,
                   help="comma-separated BQxBK[:warps:stages], e.g. 64x64,128x64:8:3")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--check-len", type=int, default=4096)
    p.add_argument("--target-speedup", type=float, default=7.0)
    return p.parse_args(argv)


ARGS = _parse_args()
if ARGS.dry_run:  # must precede the first import of triton
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from vllm_accel.kernels.block_scoring import (  # noqa: E402
    BlockScoringConfig,
    select_blocks_contiguous,
)
from vllm_accel.kernels.block_sparse_attention import (  # noqa: E402
    BlockSelection,
    QueryBlocks,
    attention_flops,
    block_sparse_attention_contiguous,
    block_sparse_attention_reference,
    dense_causal_flops,
)


def _parse_configs(text):
    out = []
    for item in text.split(","):
        parts = item.split(":")
        bq, bk = (int(x) for x in parts[0].lower().split("x"))
        warps = int(parts[1]) if len(parts) > 1 else None
        stages = int(parts[2]) if len(parts) > 2 else None
        out.append((bq, bk, warps, stages))
    return out


class Timer:
    """Median wall time of ``fn`` over ``reps`` runs after ``warmup`` runs (CUDA events on GPU)."""

    def __init__(self, device, reps, warmup=1):
        self.device, self.reps, self.warmup = device, reps, warmup

    def __call__(self, fn):
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def _dense_backends(device):
    if device.type != "cuda":
        return [("sdpa", None)]
    from torch.nn.attention import SDPBackend

    return [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]


def _dense_attention(q4, k4, v4, backend):
    if backend is None:
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)


def _inputs(n, args, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    q = torch.randn(n, hq, d, generator=g, device=device, dtype=dtype)
    k = torch.randn(n, hkv, d, generator=g, device=device, dtype=dtype)
    v = torch.randn(n, hkv, d, generator=g, device=device, dtype=dtype)
    loc = torch.tensor([0, n], dtype=torch.int32, device=device)
    return q, k, v, loc


def _scoring_config(args, bq, bk, density, method="antidiagonal"):
    stride = args.stride
    while bq % stride or bk % stride:
        stride //= 2
    return BlockScoringConfig(method=method, query_block_size=bq, key_block_size=bk,
                              stride=stride, tau=None, density=density)


def check_correctness(args, device, dtype, configs):
    """Small-length checks: density 1.0 equals dense SDPA; sparse equals the masked reference."""
    n = args.check_len
    q, k, v, loc = _inputs(n, args, device, dtype, seed=1)
    g = args.q_heads // args.kv_heads
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(g, 0)[None],
        v.transpose(0, 1).repeat_interleave(g, 0)[None], is_causal=True,
    )[0].transpose(0, 1)
    out = {}
    for bq, bk, warps, stages in configs:
        try:
            out[f"{bq}x{bk}"] = _check_config(args, q, k, v, loc, ref, dtype, device, bq, bk,
                                              warps, stages)
        except Exception as e:  # report, keep going with the other configurations
            out[f"{bq}x{bk}"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    return out


def _check_config(args, q, k, v, loc, ref, dtype, device, bq, bk, warps, stages):
    qb = QueryBlocks.build(loc.cpu()[1:], loc.cpu(), bq, device=device)
    full = BlockSelection.all_causal(qb, bk, args.kv_heads)
    o = block_sparse_attention_contiguous(q, k, v, full, loc, loc, backend="triton",
                                          num_warps=warps, num_stages=stages)
    err_dense = float((o.float() - ref.float()).abs().max())
    sel = select_blocks_contiguous(q, k, loc, loc, _scoring_config(args, bq, bk, 0.25),
                                   query_blocks=qb)
    o = block_sparse_attention_contiguous(q, k, v, sel, loc, loc, backend="triton",
                                          num_warps=warps, num_stages=stages)
    r = block_sparse_attention_reference(q, k, v, sel, None, loc[1:] - loc[:-1], loc,
                                         kv_start_loc=loc)
    err_sparse = float((o.float() - r.float()).abs().max())
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    return {
        "seq_len": q.shape[0],
        "max_abs_err_density1_vs_sdpa": err_dense,
        "max_abs_err_sparse_vs_reference": err_sparse,
        "sparse_density": sel.density(),
        "ok": err_dense < tol and err_sparse < tol,
    }


def bench_length(n, args, device, dtype, configs, timer):
    q, k, v, loc = _inputs(n, args, device, dtype)
    hq, d = args.q_heads, args.head_dim
    g = hq // args.kv_heads
    row = {"seq_len": n, "dense": {}, "ours_density1": {}, "sparse": {}}
    dense_flops = dense_causal_flops(n, hq, d)
    q4 = q.transpose(0, 1).contiguous()[None]
    k4 = k.transpose(0, 1).repeat_interleave(g, 0).contiguous()[None]
    v4 = v.transpose(0, 1).repeat_interleave(g, 0).contiguous()[None]
    for name, backend in _dense_backends(device):
        try:
            t = timer(lambda: _dense_attention(q4, k4, v4, backend))
            row["dense"][name] = {"time_s": t, "tflops": dense_flops / t / 1e12}
        except Exception as e:  # backend unavailable on this machine
            row["dense"][name] = {"error": f"{type(e).__name__}: {e}"[:200]}
    del q4, k4, v4
    for bq, bk, warps, stages in configs:
        tag = f"{bq}x{bk}" + (f":{warps}:{stages}" if warps else "")
        try:
            _bench_config(row, tag, q, k, v, loc, args, device, bq, bk, warps, stages, timer)
        except Exception as e:  # e.g. out of shared memory for a tile size: keep going
            row["sparse"][tag] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"          [{tag}] failed: {row['sparse'][tag]['error']}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    done = {t: r for t, r in row["sparse"].items() if "total_s" in r}
    if done:
        best = min(done.items(), key=lambda kv: kv[1]["total_s"])
        row["best_sparse_config"] = best[0]
        for name, r in row["dense"].items():
            if "time_s" in r:
                row[f"speedup_vs_{name}"] = r["time_s"] / best[1]["total_s"]
    return row


def _bench_config(row, tag, q, k, v, loc, args, device, bq, bk, warps, stages, timer):
    """Our kernel at density 1.0, then scoring + kernel at ``args.density``, for one tiling."""
    hq, d = args.q_heads, args.head_dim
    loc_cpu = loc.cpu()
    t0 = time.perf_counter()
    qb = QueryBlocks.build(loc_cpu[1:], loc_cpu, bq, device=device)  # per batch, not per layer
    plan_s = time.perf_counter() - t0

    def run(sel):
        return block_sparse_attention_contiguous(q, k, v, sel, loc, loc, backend="triton",
                                                 num_warps=warps, num_stages=stages)

    full = BlockSelection.all_causal(qb, bk, args.kv_heads)
    t = timer(lambda: run(full))
    row["ours_density1"][tag] = {"time_s": t, "tflops": attention_flops(full, hq, d) / t / 1e12}
    del full

    for method in args.methods.split(","):
        cfg = _scoring_config(args, bq, bk, args.density, method)
        state = {}

        def score():
            state["sel"] = select_blocks_contiguous(q, k, loc, loc, cfg, query_blocks=qb)

        def pipeline():
            score()
            run(state["sel"])

        t_total = timer(pipeline)
        t_score = timer(score)
        sel = state.pop("sel")
        t_attn = timer(lambda: run(sel))
        row["sparse"][f"{tag}/{method}"] = {
            "density": sel.density(),
            "total_s": t_total,
            "scoring_s": t_score,
            "attention_s": t_attn,
            "attention_tflops": attention_flops(sel, hq, d) / t_attn / 1e12,
            "query_blocks_plan_s": plan_s,
            "scoring": {"method": cfg.method, "stride": cfg.stride, "gqa": cfg.gqa},
        }
        del sel


def _print_row(row):
    n = row["seq_len"]
    dense = "  ".join(
        f"{k} {v['time_s'] * 1e3:8.2f} ms ({v['tflops']:5.0f} TF/s)" if "time_s" in v
        else f"{k} n/a" for k, v in row["dense"].items())
    print(f"N={n:>6}  dense: {dense}")
    for tag, r in row["ours_density1"].items():
        print(f"          ours density 1.0 [{tag:>22}] {r['time_s'] * 1e3:8.2f} ms "
              f"({r['tflops']:5.0f} TF/s)")
    for tag, r in row["sparse"].items():
        if "total_s" not in r:
            continue
        print(f"          sparse d={r['density']:.3f} [{tag:>22}] total "
              f"{r['total_s'] * 1e3:8.2f} ms = scoring {r['scoring_s'] * 1e3:7.2f} + "
              f"attention {r['attention_s'] * 1e3:7.2f} ({r['attention_tflops']:5.0f} TF/s)")
    sp = "  ".join(f"x{row[k]:.2f} vs {k[len('speedup_vs_'):]}" for k in row
                   if k.startswith("speedup_vs_"))
    print(f"          best [{row.get('best_sparse_config')}]: {sp}", flush=True)


def main(args=ARGS):
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        args.q_heads, args.kv_heads, args.head_dim = 4, 2, 32
        lengths = args.lengths or [256]
        configs = _parse_configs(args.configs or "32x16,64x32")
        reps, args.check_len, args.stride = args.reps or 1, 128, 8
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --dry-run to test the script on the CPU")
        device, dtype = torch.device("cuda"), torch.bfloat16
        lengths = args.lengths or [32768, 65536, 131072]
        default_cfg = "64x64,128x64" if args.quick else "64x64,128x64,128x128,64x64:4:2,128x64:8:2"
        configs = _parse_configs(args.configs or default_cfg)
        reps = args.reps or (3 if args.quick else 10)
    import triton

    env = {
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
        "dtype": str(dtype).replace("torch.", ""),
        "shape": {"q_heads": args.q_heads, "kv_heads": args.kv_heads,
                  "head_dim": args.head_dim},
        "density_budget": args.density, "methods": args.methods, "reps": reps,
    }
    print(json.dumps(env))
    t_start = time.perf_counter()
    checks = check_correctness(args, device, dtype, configs)
    for tag, c in checks.items():
        if "error" in c:
            print(f"check [{tag}] FAILED: {c['error']}", flush=True)
            continue
        print(f"check [{tag}] N={c['seq_len']}: density-1 vs SDPA max err "
              f"{c['max_abs_err_density1_vs_sdpa']:.2e}, sparse vs reference "
              f"{c['max_abs_err_sparse_vs_reference']:.2e} -> {'ok' if c['ok'] else 'FAIL'}",
              flush=True)
    timer = Timer(device, reps)
    rows = []
    for n in lengths:
        rows.append(bench_length(n, args, device, dtype, configs, timer))
        _print_row(rows[-1])
    target = None
    last = rows[-1]
    if "speedup_vs_cudnn" in last:
        target = {
            "seq_len": last["seq_len"], "speedup_vs_cudnn": last["speedup_vs_cudnn"],
            "required": args.target_speedup,
            "met": last["speedup_vs_cudnn"] >= args.target_speedup,
        }
        print(f"target: sparse (scoring included) >= {args.target_speedup}x cuDNN SDPA at "
              f"N={last['seq_len']}: x{last['speedup_vs_cudnn']:.2f} -> "
              f"{'MET' if target['met'] else 'NOT MET'}")
    wall = time.perf_counter() - t_start
    print(f"wall time {wall:.1f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"env": env, "configs": [list(c) for c in configs], "checks": checks,
                       "rows": rows, "target": target, "wall_s": wall}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
