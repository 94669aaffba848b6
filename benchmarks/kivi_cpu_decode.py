"""One decode step of one attention layer on the CPU: bf16 cache (SDPA over the gathered pages,
what a dense paged decode reads) vs the KIVI cache through the torch path and the native kernel.

    .venv/bin/python benchmarks/kivi_cpu_decode.py [--context 2048] [--batch 1] \
        [--heads 14 --kv-heads 2 --head-size 64] [--dtype kivi_4bit] [--repeats 20]

Prints the median milliseconds of each and the ratios against bf16, all measured in this run
(Qwen2.5-0.5B geometry by default). The bf16 row gathers the sequence's pages from a paged bf16
cache and runs SDPA, like the KIVI torch path does after dequantizing.
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

    rows = {"bf16 (gather + SDPA)": median_ms(bf16, args.repeats),
            f"{args.dtype} torch path": median_ms(kivi("torch"), args.repeats)}
    if HAS_NATIVE:
        rows[f"{args.dtype} native"] = median_ms(kivi("native"), args.repeats)
    base = rows["bf16 (gather + SDPA)"]
    print(f"decode, one layer: batch {b}, context {L}, {hq}/{hkv} heads, D={d}, "
          f"{torch.get_num_threads()} threads")
    for name, ms in rows.items():
        print(f"  {name:28s} {ms:8.3f} ms   speed vs bf16 {base / ms:5.2f}x")


if __name__ == "__main__":
    main()
