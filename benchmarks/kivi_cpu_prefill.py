"""One prefill chunk of one attention layer over the KIVI cache on the CPU: the torch reference
(dequantize the whole sequence, one SDPA with an explicit causal mask: the prefill path before
the split) against the split flash attention (``kernel: native``'s prefill rows), with the
chunk's own K/V from the cache (``prefill_kv: cache``) or unquantized (``exact``), and with
``exact`` plus the whole context from the exact prompt buffer (``prompt_exact_tokens``: the
context is the same prompt's earlier prefill steps, held unquantized).

    .venv/bin/python benchmarks/kivi_cpu_prefill.py [--chunk 4096 --context 4096] \
        [--heads 14 --kv-heads 2 --head-size 64] [--dtype kivi_4bit] [--repeats 5]

Prints the median milliseconds of each and the speedup over the reference, all measured in this
run (Qwen2.5-0.5B geometry, bf16 queries by default; ``--query-dtype float32`` for fp32 models).
"""

from __future__ import annotations

import argparse

import torch
from kivi_cpu_decode import add_geometry_args, median_ms  # benchmarks/, next to this script

from vllm_accel.kernels.kivi_attention import kivi_paged_attention
from vllm_accel.kernels.kivi_cache import quantize_on_write, tail_entries
from vllm_accel.kernels.kivi_format import KiviLayout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--context", type=int, default=4096)
    add_geometry_args(ap)
    ap.add_argument("--query-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    lq, ctx, hq, hkv, d, n = (args.chunk, args.context, args.heads, args.kv_heads,
                              args.head_size, args.block_size)
    qdt = getattr(torch, args.query_dtype)
    L = ctx + lq
    lay = KiviLayout.preset(args.dtype, head_size=d, block_size=n, dtype=qdt)
    pages = -(-L // n)
    table = torch.arange(pages, dtype=torch.int32)[None]
    k = torch.randn(L, hkv, d, dtype=qdt)
    v = torch.randn(L, hkv, d, dtype=qdt)
    lens = torch.tensor([L], dtype=torch.int32)
    cache, tail = lay.allocate(pages, hkv), lay.allocate_tail(1, hkv)
    tail_mapping, tail_index = tail_entries(torch.tensor([0, L]), lens, lay.key_group,
                                            entries_per_slot=1)
    quantize_on_write(k, v, cache, torch.arange(L), lay, k_tail=tail, tail_mapping=tail_mapping)
    q = torch.randn(lq, hq, d, dtype=qdt)
    qsl = torch.tensor([0, lq])
    own = (k[ctx:], v[ctx:])

    earlier = [(k[:ctx], v[:ctx])]

    def run(backend, chunk_kv=None, context_kv=None):
        return lambda: kivi_paged_attention(q, cache, table, lens, qsl, d ** -0.5, lay,
                                            k_tail=tail, tail_index=tail_index,
                                            backend=backend, chunk_kv=chunk_kv,
                                            context_kv=context_kv)

    rows = {
        "reference (dequantize all + masked SDPA)": median_ms(run("torch"), args.repeats),
        "split, prefill_kv=cache": median_ms(run("native"), args.repeats),
        "split, prefill_kv=exact": median_ms(run("native", own), args.repeats),
        "split, exact + prompt buffer": median_ms(run("native", own, earlier), args.repeats),
    }
    base = rows["reference (dequantize all + masked SDPA)"]
    print(f"{args.dtype}, chunk {lq} over context {ctx}, {hq}/{hkv} heads, D={d}, "
          f"{args.query_dtype} queries, {torch.get_num_threads()} threads")
    for name, ms in rows.items():
        print(f"  {name:42s} {ms:9.1f} ms   {base / ms:5.2f}x")


if __name__ == "__main__":
    main()
