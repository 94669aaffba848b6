"""CPU micro-benchmark: dense causal attention vs block-sparse prefill (scoring included).

One attention layer of a single-sequence prefill at 4K/8K/16K tokens, Qwen2.5-0.5B shape
(14 query heads, 2 KV heads, head_dim 64, bf16), K/V in a vLLM CPU-layout paged cache
(pages of 128 tokens). Timed in the same run, interleaved, best of ``--reps``:

* ``dense``: ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)``;
* ``vllm``:  vLLM's own CPU attention kernel (``cpu_attention_with_kv_cache``) over the same
  paged cache, when vLLM is importable (the baseline the product has to beat);
* ``score``: block scoring + selection (``select_blocks``), ``attn``: the sparse attention
  (torch CPU path), ``sparse`` = score + attn.

Inputs are random, so a cumulative-mass threshold would keep almost everything: the selection
uses a top-k budget (``--density``, fraction of causal blocks) on top of the always-kept sink
and local blocks; the achieved density is printed. Usage::

    nice -n 10 python benchmarks/cpu_sparse_attention.py [--lengths 4096 8192 16384]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from vllm_accel.kernels.block_scoring import BlockScoringConfig, select_blocks
from vllm_accel.kernels.block_sparse_attention import (
    QueryBlocks,
    block_sparse_attention,
    kv_cache_views_cpu,
)


def _cpu_attention_isa(dtype, head_dim):
    """The ISA vLLM's CPU backend picks here (same rule as ``cpu_attn._get_attn_isa`` on x86)."""
    if head_dim % 32 and head_dim % 16 == 0:
        return "vec16"
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16:
        return "amx"
    return "vec"


def _vllm_ops():
    try:
        from vllm import _custom_ops as ops

        ops.cpu_attention_with_kv_cache  # noqa: B018
        return ops
    except Exception:
        return None


def _vllm_cpu_attention(ops, isa, head_dim):
    """vLLM's CPU attention as ``fn(query, kv_cache, block_table, seq_lens, qsl, scale, out)``."""

    def run(query, kv_cache, block_table, seq_lens, qsl, scale, out):
        num_pages, num_kv_heads, page, _ = kv_cache.shape
        kv = kv_cache.view(num_pages, num_kv_heads, 2 * page, head_dim)
        key_cache, value_cache = kv.chunk(2, dim=2)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=query.shape[1], num_kv_heads=num_kv_heads,
            head_dim=head_dim, seq_lens=seq_lens, dtype=query.dtype, query_start_loc=qsl,
            causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        )
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=qsl, seq_lens=seq_lens, scale=scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
            scheduler_metadata=meta, s_aux=None,
        )
        return out

    return run


def _fill_cache(kv_cache, k, v, isa, ops):
    """Write K/V of one sequence (pages 0, 1, ...) in the layout of ``isa``: with vLLM's own
    writer when available, else through our views (``vec`` layout)."""
    n, num_pages, page = k.shape[0], kv_cache.shape[0], kv_cache.shape[2]
    if ops is not None:
        key_tiles, value_tiles = kv_cache.view(num_pages, kv_cache.shape[1], 2 * page,
                                               -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_tiles, value_tiles, torch.arange(n), isa)
        return
    k_cache, v_cache = kv_cache_views_cpu(kv_cache, isa)
    for p in range(-(-n // page)):
        k_cache[p, : min(page, n - p * page)] = k[p * page : (p + 1) * page]
        v_cache[p, : min(page, n - p * page)] = v[p * page : (p + 1) * page]


def _best_time(fn, reps):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_length(n, args, ops, isa):
    torch.manual_seed(0)
    hq, hkv, d, page = args.q_heads, args.kv_heads, args.head_dim, args.page_size
    dt = torch.bfloat16
    q = torch.randn(n, hq, d, dtype=dt)
    k = torch.randn(n, hkv, d, dtype=dt)
    v = torch.randn(n, hkv, d, dtype=dt)
    num_pages = -(-n // page)
    kv_cache = torch.zeros(num_pages, hkv, page, 2 * d, dtype=dt)
    _fill_cache(kv_cache, k, v, isa, ops)
    k_cache, v_cache = kv_cache_views_cpu(kv_cache, isa)
    vllm_attn = None if ops is None else _vllm_cpu_attention(ops, isa, d)
    block_table = torch.arange(num_pages, dtype=torch.int32)[None]
    seq_lens = torch.tensor([n], dtype=torch.int32)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    scale = d**-0.5
    cfg = BlockScoringConfig(
        method=args.method, query_block_size=args.query_block, key_block_size=args.key_block,
        stride=args.stride, tau=args.tau, density=args.density,
        num_sink_blocks=1, num_local_blocks=1,
    )
    qblocks = QueryBlocks.build(seq_lens, qsl, args.query_block)
    out_v = torch.empty_like(q)

    def dense():
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, enable_gqa=True,
        )

    state = {}

    def score():
        state["sel"] = select_blocks(q, k_cache, block_table, seq_lens, qsl, cfg,
                                     query_blocks=qblocks)

    def attn():
        return block_sparse_attention(q, k_cache, v_cache, state["sel"], block_table, seq_lens,
                                      qsl, scale=scale, backend="torch")

    def vllm():
        return vllm_attn(q, kv_cache, block_table, seq_lens, qsl, scale, out_v)

    fns = {"dense": dense, "score": score, "attn": attn}
    if vllm_attn is not None:
        fns["vllm"] = vllm
    for fn in fns.values():  # warm-up (and the selection used by attn)
        fn()
    times = {name: float("inf") for name in fns}
    for _ in range(args.reps):  # interleaved, best of reps
        for name, fn in fns.items():
            times[name] = min(times[name], _best_time(fn, 1))
    sel = state["sel"]
    row = {
        "seq_len": n,
        "density": sel.density(),
        "dense_s": times["dense"],
        "vllm_s": times.get("vllm"),
        "score_s": times["score"],
        "attn_s": times["attn"],
        "sparse_s": times["score"] + times["attn"],
    }
    row["speedup_vs_dense"] = row["dense_s"] / row["sparse_s"]
    if row["vllm_s"] is not None:
        row["speedup_vs_vllm"] = row["vllm_s"] / row["sparse_s"]
    if args.check:
        ref = dense()[0].transpose(0, 1).float()
        got = attn().float()
        row["rel_err_vs_dense"] = float((got - ref).norm() / ref.norm())
        if vllm_attn is not None:
            row["vllm_rel_err_vs_dense"] = float((vllm().float() - ref).norm() / ref.norm())
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--q-heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--method", default="antidiagonal", choices=["antidiagonal", "mean_pool"])
    p.add_argument("--query-block", type=int, default=256)
    p.add_argument("--key-block", type=int, default=64)
    p.add_argument("--stride", type=int, default=16)
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--tau", type=float, default=None)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's CPU attention baseline")
    p.add_argument("--check", action="store_true", help="also report errors vs dense")
    p.add_argument("--json", default=None, help="write the rows as JSON to this path")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = None if args.no_vllm else _vllm_ops()
    isa = _cpu_attention_isa(torch.bfloat16, args.head_dim)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; Hq={args.q_heads} "
          f"Hkv={args.kv_heads} D={args.head_dim} bf16; {args.method} stride {args.stride}, "
          f"blocks {args.query_block}x{args.key_block}, budget density={args.density} "
          f"tau={args.tau}; KV pages: vLLM CPU layout, isa {isa}; "
          f"vLLM baseline: {'yes' if ops else 'no'}")
    hdr = (f"{'N':>6} {'density':>7} {'dense s':>8} {'vllm s':>8} {'score s':>8} {'attn s':>8} "
           f"{'sparse s':>8} {'x dense':>8} {'x vllm':>7}")
    print(hdr)
    rows = []
    for n in args.lengths:
        r = bench_length(n, args, ops, isa)
        rows.append(r)
        vl = f"{r['vllm_s']:8.3f}" if r["vllm_s"] is not None else f"{'-':>8}"
        xv = f"{r['speedup_vs_vllm']:7.2f}" if r["vllm_s"] is not None else f"{'-':>7}"
        print(f"{n:>6} {r['density']:7.3f} {r['dense_s']:8.3f} {vl} {r['score_s']:8.3f} "
              f"{r['attn_s']:8.3f} {r['sparse_s']:8.3f} {r['speedup_vs_dense']:8.2f} {xv}"
              + (f"  rel.err sparse {r['rel_err_vs_dense']:.3f}" if "rel_err_vs_dense" in r
                 else "")
              + (f" vllm {r['vllm_rel_err_vs_dense']:.4f}" if "vllm_rel_err_vs_dense" in r
                 else ""),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
