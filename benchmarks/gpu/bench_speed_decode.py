"""SPEED upper-layer decode attention (Triton) vs dense decode over the whole prompt (SDPA).

Needs only torch + triton (no vLLM, no install of vllm_accel)::

    PYTHONPATH=. python benchmarks/gpu/bench_speed_decode.py --json out.json

Logic check on a CPU machine (Triton interpreter, tiny shapes, timings meaningless)::

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/gpu/bench_speed_decode.py --device cpu

Shape: Llama-8B-like decode step (32 query / 8 KV heads, head size 128), a batch of B requests,
each with a ``prompt``-token prompt and ``decoded`` generated tokens, pages of 16 tokens in random
order, the skipped prompt pages pointing at one null page (as vLLM's block manager does). In an
upper layer SPEED attends to the anchor and the decoded tokens only; the dense baseline is what
the same layer costs without SPEED (SDPA over the full context, K/V already contiguous: a lower
bound for a paged dense kernel). Every shape is also checked: the Triton kernel against the torch
path on the same device (exit status 1 if they differ).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F

from vllm_accel.kernels.speed_attention import speed_upper_attention


def build(batch, prompt, decoded, hq, hkv, d, page, dtype, device, anchor=1):
    seq = prompt + decoded
    pages_per_req = -(-seq // page)
    num_pages = 1 + batch * pages_per_req
    k_pages = torch.randn(num_pages, page, hkv, d, dtype=dtype, device=device)
    v_pages = torch.randn(num_pages, page, hkv, d, dtype=dtype, device=device)
    perm = torch.randperm(num_pages - 1) + 1
    table = perm[: batch * pages_per_req].reshape(batch, pages_per_req).to(torch.int32)
    first_live, last_anchor = (prompt - 1) // page, (anchor - 1) // page
    table[:, last_anchor + 1: first_live] = 0  # the null page
    query = torch.randn(batch, hq, d, dtype=dtype, device=device)
    return dict(query=query, query_positions=torch.full((batch,), seq - 1),
                query_start_loc=list(range(batch + 1)), key_pages=k_pages, value_pages=v_pages,
                block_table=table.to(device), seq_lens=[seq] * batch,
                prompt_lens=[prompt] * batch, anchor_tokens=anchor, scale=d ** -0.5)


def timed(fn, device, reps):
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=reps) * 1e-3
    import time

    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--decoded", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    hq, hkv, d, page = (32, 8, 128, 16) if gpu else (4, 2, 32, 16)
    dtype = torch.bfloat16 if gpu else torch.float32
    prompts = [8192, 32768, 131072] if gpu else [200]
    batch, decoded = (args.batch, args.decoded) if gpu else (2, 20)
    rows = []
    for prompt in prompts:
        case = build(batch, prompt, decoded, hq, hkv, d, page, dtype, args.device)
        tri = speed_upper_attention(**case, backend="triton")
        ref = speed_upper_attention(**case, backend="torch")
        err = (tri.float() - ref.float()).abs().max().item()
        seq = prompt + decoded
        k = torch.randn(batch, hkv, seq, d, dtype=dtype, device=args.device)
        v = torch.randn_like(k)
        q = case["query"].unsqueeze(2)  # [B, Hq, 1, D]
        t_speed = timed(lambda: speed_upper_attention(**case, backend="triton"), args.device, 50)
        t_dense = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                        args.device, 50)
        rows.append(dict(prompt=prompt, decoded=decoded, batch=batch, max_abs_err_vs_torch=err,
                         speed_upper_ms=t_speed * 1e3, dense_sdpa_ms=t_dense * 1e3,
                         speedup=t_dense / t_speed))
        print(f"prompt {prompt:>6} +{decoded} decoded, B={batch}: SPEED upper "
              f"{t_speed * 1e3:8.3f} ms  dense SDPA {t_dense * 1e3:8.3f} ms  "
              f"{t_dense / t_speed:6.1f}x  (max |triton - torch| {err:.2e})")
    result = dict(device=torch.cuda.get_device_name() if gpu else platform.processor(),
                  shape=dict(hq=hq, hkv=hkv, d=d, page=page, dtype=str(dtype)), rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    bad = [r for r in rows if r["max_abs_err_vs_torch"] > (2e-2 if gpu else 1e-4)]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
