"""One layer's KIVI decode step through the Python entry points the backend calls: the write
(``kivi_cache.quantize_on_write``) and the attention (``kivi_attention.kivi_paged_attention``),
everything around the native kernels included (``benchmarks/kivi_cpu_decode.py`` times the
attention kernel alone).

    .venv/bin/python benchmarks/kivi_cpu_layer_step.py [--value-rotation none] [--context 2048]

Prints the median write time over decode steps that append one token each, and the attention
time as the minimum of 7 medians of 100 identical calls (this CPU is noisy). Qwen2.5-0.5B
geometry: 14 query heads, 2 KV heads, D=64, float32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_accel.kernels.kivi_attention import kivi_paged_attention
from vllm_accel.kernels.kivi_cache import quantize_on_write
from vllm_accel.kernels.kivi_format import KiviLayout

HQ, HKV, D = 14, 2, 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="kivi_4bit", choices=("kivi_4bit", "kivi_2bit"))
    ap.add_argument("--value-rotation", default="hadamard", choices=("hadamard", "none"))
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layout = KiviLayout.preset(args.dtype, head_size=D, block_size=128, dtype=torch.float32,
                               value_rotation=args.value_rotation)
    n = args.context
    num_blocks = n // 128 + 2
    cache, tail = layout.allocate(num_blocks, HKV), layout.allocate_tail(2, HKV)
    quantize_on_write(torch.randn(n, HKV, D), torch.randn(n, HKV, D), cache, torch.arange(n),
                      layout, k_tail=tail, tail_mapping=torch.zeros(n, dtype=torch.long))
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    entry = torch.tensor([1])

    writes = []
    for i in range(180):  # one decode token per step, as the engine writes them
        k, v = torch.randn(1, HKV, D), torch.randn(1, HKV, D)
        t = time.perf_counter()
        quantize_on_write(k, v, cache, torch.tensor([n + i]), layout, k_tail=tail,
                          tail_mapping=entry)
        writes.append(time.perf_counter() - t)

    q, out = torch.randn(1, HQ, D), torch.empty(1, HQ, D)
    call = dict(out=out, max_query_len=1, max_seq_len=n + 1, k_tail=tail, tail_index=entry,
                chunk_kv=(torch.randn(1, HKV, D), torch.randn(1, HKV, D)), chunk_kv_min_rows=2)
    pos = (q, cache, table, torch.tensor([n + 1], dtype=torch.int32),
           torch.tensor([0, 1], dtype=torch.int32), D ** -0.5, layout)
    medians = []
    for _ in range(7):
        times = []
        for _ in range(100):
            t = time.perf_counter()
            kivi_paged_attention(*pos, **call)
            times.append(time.perf_counter() - t)
        medians.append(statistics.median(times))
    print(f"{args.dtype}, value_rotation={args.value_rotation}, {n} tokens: "
          f"write {statistics.median(writes) * 1e6:.0f} us (median), "
          f"attention {min(medians) * 1e6:.0f} us (min of 7 medians)")


if __name__ == "__main__":
    main()
