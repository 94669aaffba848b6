"""One decode step of one attention layer on the CPU: bf16 cache (vLLM's own CPU attention
kernel, what ``--kv-cache-dtype auto`` runs, and SDPA over the gathered pages) vs the KIVI cache
through the torch path and the native kernel.

    .venv/bin/python benchmarks/kivi_cpu_decode.py [--context 2048] [--batch 1] \
        [--heads 14 --kv-heads 2 --head-size 64] [--dtype kivi_4bit] [--repeats 20]

Prints the median milliseconds of each and the speed relative to vLLM's kernel (to the gather
row where vLLM is not installed), all measured in this run (Qwen2.5-0.5B geometry by default).
The gather row gathers the sequence's pages from a paged bf16 cache and runs SDPA, like the KIVI
torch path does after dequantizing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_accel.kernels.kivi_attention import kivi_paged_attention
from vllm_accel.kernels.kivi_cache import quantize_on_write, tail_entries
from vllm_accel.kernels.kivi_cpu import HAS_NATIVE
from vllm_accel.kernels.kivi_format import KiviLayout


def median_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def add_geometry_args(ap: argparse.ArgumentParser) -> None:
    """One layer's shape (Qwen2.5-0.5B by default) and the KIVI dtype."""
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--dtype", default="kivi_4bit")
    ap.add_argument("--block-size", type=int, default=128)


def vllm_cpu_decode(k, v, q, table, lens, slots, num_blocks, block_size):
    """vLLM's own CPU decode over a bf16 paged cache (what ``--kv-cache-dtype auto`` runs in
    the engine, AMX where the CPU has it), as a call, checked against SDPA; None without vLLM.
    """
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    b, hq, d = q.shape
    hkv = k.shape[1]
    isa = _get_attn_isa(torch.bfloat16, block_size, d)
    kv = torch.zeros(num_blocks, hkv, 2 * block_size, d, dtype=torch.bfloat16)
    key_cache, value_cache = kv.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=b, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=lens,
        dtype=torch.bfloat16, query_start_loc=qsl, causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=True)
    out = torch.empty_like(q)

    def run():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=qsl, seq_lens=lens, scale=d ** -0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
            scheduler_metadata=meta, s_aux=None)

    run()
    length = int(lens[0])
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:1].float().transpose(0, 1)[None], k[:length].float().transpose(0, 1)[None],
        v[:length].float().transpose(0, 1)[None], scale=d ** -0.5, enable_gqa=hq != hkv)
    err = float((out[0].float() - want[0].transpose(0, 1)).abs().max())
    if err > 0.05:
        raise SystemExit(f"vLLM's CPU decode disagrees with SDPA here (max error {err:.3g})")
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    add_geometry_args(ap)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    b, L, hq, hkv, d, n = (args.batch, args.context, args.heads, args.kv_heads, args.head_size,
                           args.block_size)
    lay = KiviLayout.preset(args.dtype, head_size=d, block_size=n)
    pages = -(-L // n)
    table = torch.arange(b * pages, dtype=torch.int32).reshape(b, pages)
    k = torch.randn(b * L, hkv, d, dtype=torch.bfloat16)
    v = torch.randn(b * L, hkv, d, dtype=torch.bfloat16)
    lens = torch.full((b,), L, dtype=torch.int32)
    qsl_all = torch.arange(b + 1) * L
    slots = torch.cat([table[i, torch.arange(L) // n].long() * n + torch.arange(L) % n
                       for i in range(b)])
    cache, tail = lay.allocate(b * pages, hkv), lay.allocate_tail(b, hkv)
    tail_mapping, tail_index = tail_entries(qsl_all, lens, lay.key_group, entries_per_slot=1)
    quantize_on_write(k, v, cache, slots, lay, k_tail=tail, tail_mapping=tail_mapping)
    dense_k = torch.zeros(b * pages * n, hkv, d, dtype=torch.bfloat16)
    dense_v = torch.zeros_like(dense_k)
    dense_k[slots], dense_v[slots] = k, v
    dense_k, dense_v = (x.view(b * pages, n, hkv, d) for x in (dense_k, dense_v))
    q = torch.randn(b, hq, d, dtype=torch.bfloat16)
    qsl = torch.arange(b + 1)

    def bf16():
        for i in range(b):
            kk = dense_k[table[i].long()].reshape(-1, hkv, d)[:L].transpose(0, 1)[None]
            vv = dense_v[table[i].long()].reshape(-1, hkv, d)[:L].transpose(0, 1)[None]
            torch.nn.functional.scaled_dot_product_attention(
                q[i:i + 1].transpose(0, 1)[None], kk, vv, scale=d ** -0.5,
                enable_gqa=hq != hkv)

    def kivi(backend):
        return lambda: kivi_paged_attention(q, cache, table, lens, qsl, d ** -0.5, lay,
                                            k_tail=tail, tail_index=tail_index, backend=backend)

    rows = {"bf16 (gather + SDPA)": median_ms(bf16, args.repeats)}
    engine_bf16 = vllm_cpu_decode(k, v, q, table, lens, slots, b * pages, n)
    if engine_bf16 is not None:
        rows["bf16, vLLM's CPU kernel"] = median_ms(engine_bf16, args.repeats)
    rows[f"{args.dtype} torch path"] = median_ms(kivi("torch"), args.repeats)
    if HAS_NATIVE:
        rows[f"{args.dtype} native"] = median_ms(kivi("native"), args.repeats)
    base_name = next(name for name in ("bf16, vLLM's CPU kernel", "bf16 (gather + SDPA)")
                     if name in rows)
    base = rows[base_name]
    print(f"decode, one layer: batch {b}, context {L}, {hq}/{hkv} heads, D={d}, "
          f"{torch.get_num_threads()} threads; speed relative to {base_name}")
    for name, ms in rows.items():
        print(f"  {name:28s} {ms:8.3f} ms   speed {base / ms:5.2f}x")


if __name__ == "__main__":
    main()
