"""Decode-attention bandwidth: bf16 SDPA (cuDNN, flash) vs the fused KIVI 4-bit / 2-bit kernels.

Needs only torch + triton (no vLLM, no install of vllm_accel)::

    PYTHONPATH=. python benchmarks/gpu/bench_kivi_decode.py --quick --json out.json

Logic check on a CPU machine (Triton interpreter, tiny shapes, timings meaningless)::

    PYTHONPATH=. python benchmarks/gpu/bench_kivi_decode.py --device cpu

Ahead-of-time compilation for a GPU that is not there (Triton's bundled ptxas; reports registers,
spills, shared memory and whether the main loop's loads became ``cp.async`` pipelined copies)::

    PYTHONPATH=. python benchmarks/gpu/bench_kivi_decode.py --compile-only [--arch 90]

Shape: Llama-8B-like decode step (32 query / 8 KV heads, head size 128), a batch of B sequences
of ``context`` tokens each (13 tokens short of a key-group boundary, so the tail is read too),
pages of 128 tokens in random order.  Reported bandwidth = bytes the method must read / median
time (L2 flushed between runs by ``triton.testing.do_bench``):

* bf16 SDPA: K and V of all tokens, the query and the output;
* KIVI fused kernel (``kivi_paged_attention``, Triton): per sequence and KV head the packed K and
  V codes, the key scale/zero rows, the value scale/zero, the full-precision tail rows of the
  unfinished key group, plus block table, query and output.

The KIVI caches of the timing runs hold random bytes with sane fp16 scales (bandwidth does not
depend on the values); ``--check`` verifies the kernels on real data at a small shape (fused
Triton attention vs the torch reference on the same device, and the Triton write path vs the
torch write path).  ``--tune`` sweeps launch options of the fused kernel on one context first.
Target (issue): the fused 4-bit kernel reads the packed cache at >= 3.2 TB/s (H200 ~4.3 TB/s).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time

H200_PEAK_GBPS = 4300.0
TARGET_4BIT_GBPS = 3200.0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="contexts 8K/32K/128K, short timing, small tuning sweep",
    )
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--num-q-heads", type=int, default=None)
    ap.add_argument("--num-kv-heads", type=int, default=None)
    ap.add_argument("--head-size", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--contexts", default=None, help="comma-separated context lengths")
    ap.add_argument("--formats", default="kivi_4bit,kivi_2bit")
    ap.add_argument(
        "--rep-ms", type=int, default=None, help="do_bench repetition time per measurement"
    )
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument(
        "--no-naive", action="store_true", help="skip dequantize-then-SDPA at the smallest context"
    )
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="AOT-compile the fused kernel configs, no GPU needed",
    )
    ap.add_argument(
        "--arch", type=int, default=90, help="CUDA compute capability for --compile-only"
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        return _compile_only(args)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    from vllm_accel.kernels.kivi_attention import kivi_paged_attention
    from vllm_accel.kernels.kivi_cache import dequantize_pages, quantize_on_write
    from vllm_accel.kernels.kivi_format import KiviLayout

    dev = torch.device(args.device)
    cpu = dev.type == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu for a logic check", file=sys.stderr)
        return 2
    defaults = (
        dict(batch=2, hq=8, hkv=2, d=64, n=64, contexts=[200], rep=1)
        if cpu
        else dict(
            batch=32,
            hq=32,
            hkv=8,
            d=128,
            n=128,
            contexts=[8192, 32768, 131072] if args.quick else [8192, 16384, 32768, 65536, 131072],
            rep=40 if args.quick else 200,
        )
    )
    B = args.batch or defaults["batch"]
    HQ = args.num_q_heads or defaults["hq"]
    HKV = args.num_kv_heads or defaults["hkv"]
    D = args.head_size or defaults["d"]
    N = args.block_size or defaults["n"]
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else defaults["contexts"]
    rep_ms = args.rep_ms or defaults["rep"]
    formats = [f for f in args.formats.split(",") if f]
    scale = D**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)

    def timed(fn):
        """Median milliseconds of fn().

        GPU: replayed as a CUDA graph (``do_bench_cudagraph``), so host launch overhead -- larger
        than the kernel itself at 8K context -- is not counted, as in a vLLM decode step captured
        in a graph; falls back to ``do_bench`` (L2 flushed) if capture fails.  CPU: one run.
        """
        if cpu:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import triton.testing

        fn()  # compile / warm up outside the capture
        torch.cuda.synchronize()
        try:
            return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
        except Exception as e:  # capture not possible: eager timing
            print(
                f"  (cuda graph timing failed: {type(e).__name__}: {str(e)[:100]}; eager do_bench)"
            )
            torch.cuda.synchronize()
            return float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))

    def free():
        if not cpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    info = {
        "device": torch.cuda.get_device_name(dev) if not cpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "shape": dict(batch=B, num_q_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=N),
        "peak_gbps_assumed": H200_PEAK_GBPS,
        "interpreter": cpu,
    }
    results, tuning, check = [], [], {}
    print(f"# {info['device']}  torch {info['torch']}  triton {info['triton']}", end="  ")
    print(f"B={B} Hq={HQ} Hkv={HKV} D={D} N={N}")

    # ---------------------------------------------------------- correctness at a small shape
    if not args.no_check:
        check = _check(
            torch,
            KiviLayout,
            quantize_on_write,
            kivi_paged_attention,
            dev,
            formats,
            HQ,
            HKV,
            D,
            N,
            scale,
        )
        for k, v in check.items():
            print(f"check {k}: {v}")

    def record(context, method, fmt, ms, nbytes, extra=None):
        gbps = nbytes / (ms * 1e-3) / 1e9
        row = dict(
            context=context,
            method=method,
            format=fmt,
            ms=round(ms, 4),
            bytes=int(nbytes),
            gbps=round(gbps, 1),
            pct_of_peak=round(100 * gbps / H200_PEAK_GBPS, 1),
        )
        if extra:
            row.update(extra)
        results.append(row)
        print(
            f"{context:>7} {method:<22} {fmt:<10} {ms:9.3f} ms {gbps:9.1f} GB/s  "
            f"{row['pct_of_peak']:5.1f}% of 4.3 TB/s"
        )

    def make_kivi(fmt, context):
        lay = KiviLayout.preset(fmt, head_size=D, block_size=N)
        seq_len = context - 13
        pages = -(-seq_len // N)
        num_blocks = B * pages
        cache = torch.randint(
            0,
            256,
            (num_blocks, HKV, N, lay.bytes_per_token_head),
            dtype=torch.uint8,
            device=dev,
            generator=gen,
        )
        v = lay.views(cache)
        v.k_scale.uniform_(0.005, 0.02, generator=gen)
        v.k_zero.uniform_(-0.15, -0.05, generator=gen)
        v.v_scale.uniform_(0.005, 0.02, generator=gen)
        v.v_zero.uniform_(-0.15, -0.05, generator=gen)
        if lay.sink_tokens:
            v.sink_k.normal_(generator=gen)
            v.sink_v.normal_(generator=gen)
        tail = torch.randn(B, HKV, lay.key_group, D, device=dev, generator=gen).to(lay.dtype)
        block_table = (
            torch.randperm(num_blocks, device=dev, generator=gen).to(torch.int32).view(B, pages)
        )
        state = dict(
            lay=lay,
            cache=cache,
            tail=tail,
            block_table=block_table,
            seq_lens=torch.full((B,), seq_len, dtype=torch.int32, device=dev),
            qsl=torch.arange(B + 1, dtype=torch.int32, device=dev),
            tail_index=torch.arange(B, dtype=torch.int32, device=dev),
            query=torch.randn(B, HQ, D, device=dev, generator=gen).to(torch.bfloat16),
            seq_len=seq_len,
        )
        state["out"] = torch.empty_like(state["query"])
        state["bytes"] = _kivi_bytes(lay, B, HQ, HKV, seq_len)
        return state

    def run_kivi(st, **kw):
        return kivi_paged_attention(
            st["query"],
            st["cache"],
            st["block_table"],
            st["seq_lens"],
            st["qsl"],
            scale,
            st["lay"],
            k_tail=st["tail"],
            tail_index=st["tail_index"],
            out=st["out"],
            max_query_len=1,
            max_seq_len=st["seq_len"],
            backend="triton",
            **kw,
        )

    # ------------------------------------------------------------------ tuning sweep (one context)
    best = dict(num_warps=4, num_stages=2, fold=True, split_factor=1)
    if not args.no_tune and not cpu and formats:
        ctx = contexts[len(contexts) // 2]
        st = make_kivi(formats[0], ctx)
        from vllm_accel.kernels.kivi_attention import choose_num_splits

        base_splits = choose_num_splits(
            B * HKV, -(-st["seq_len"] // min(st["lay"].key_group, 64)), dev
        )
        configs = [
            dict(num_warps=4, num_stages=2, fold=True, split_factor=1),
            dict(num_warps=4, num_stages=3, fold=True, split_factor=1),
            dict(num_warps=8, num_stages=2, fold=True, split_factor=1),
            dict(num_warps=8, num_stages=3, fold=True, split_factor=1),
            dict(num_warps=4, num_stages=2, fold=False, split_factor=1),
            dict(num_warps=4, num_stages=2, fold=True, split_factor=2),
            dict(num_warps=4, num_stages=3, fold=True, split_factor=1, block_n=32),
        ]
        best_ms = None
        for cfg in configs:
            kw = dict(
                num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
                fold=cfg["fold"],
                num_splits=base_splits * cfg["split_factor"],
                block_n=cfg.get("block_n"),
            )
            try:
                ms = timed(functools.partial(run_kivi, st, **kw))
            except Exception as e:  # a config that does not compile is reported, not fatal
                tuning.append(
                    dict(
                        cfg, context=ctx, format=formats[0], error=f"{type(e).__name__}: {e}"[:300]
                    )
                )
                print(f"tune {cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            gbps = st["bytes"] / (ms * 1e-3) / 1e9
            tuning.append(
                dict(
                    cfg,
                    context=ctx,
                    format=formats[0],
                    num_splits=kw["num_splits"],
                    ms=round(ms, 4),
                    gbps=round(gbps, 1),
                )
            )
            print(
                f"tune {formats[0]} ctx={ctx} {cfg} splits={kw['num_splits']}: "
                f"{ms:.3f} ms {gbps:.1f} GB/s"
            )
            if best_ms is None or ms < best_ms:
                best_ms, best = ms, cfg
        st = None
        free()
        print(f"tune best: {best}")

    # ------------------------------------------------------------------ main table
    for ctx in contexts:
        seq_len = ctx - 13
        # bf16 SDPA baselines
        q = torch.randn(B, HQ, 1, D, device=dev, generator=gen, dtype=torch.bfloat16)
        k = torch.randn(B, HKV, seq_len, D, device=dev, generator=gen, dtype=torch.bfloat16)
        v = torch.randn(B, HKV, seq_len, D, device=dev, generator=gen, dtype=torch.bfloat16)
        bf16_bytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
        for name, backend in _sdpa_backends(torch, cpu):
            ms, extra = _time_sdpa(torch, timed, q, k, v, scale, backend)
            if ms is None:
                results.append(dict(context=ctx, method=name, format="bf16", error=extra["error"]))
                print(f"{ctx:>7} {name:<22} bf16       error: {extra['error'][:120]}")
                continue
            record(ctx, name, "bf16", ms, bf16_bytes * extra.pop("bytes_factor", 1), extra)
        del q, k, v
        free()
        # KIVI fused kernels
        for fmt in formats:
            st = make_kivi(fmt, ctx)
            lay = st["lay"]
            kw = dict(
                num_warps=best["num_warps"],
                num_stages=best["num_stages"],
                fold=best["fold"],
                block_n=best.get("block_n"),
            )
            if best["split_factor"] != 1 and not cpu:
                from vllm_accel.kernels.kivi_attention import choose_num_splits

                kw["num_splits"] = best["split_factor"] * choose_num_splits(
                    B * HKV, -(-st["seq_len"] // min(lay.key_group, 64)), dev
                )
            try:
                ms = timed(functools.partial(run_kivi, st, **kw))
                record(
                    ctx,
                    "kivi_fused_triton",
                    fmt,
                    ms,
                    st["bytes"],
                    dict(
                        bytes_per_token_head=lay.bytes_per_token_head,
                        capacity_ratio=round(lay.capacity_ratio_vs_bf16, 3),
                        **kw,
                    ),
                )
            except Exception as e:
                results.append(
                    dict(
                        context=ctx,
                        method="kivi_fused_triton",
                        format=fmt,
                        error=f"{type(e).__name__}: {e}"[:300],
                    )
                )
                print(f"{ctx:>7} kivi_fused_triton      {fmt:<10} error: ", end="")
                print(f"{type(e).__name__}: {str(e)[:200]}")
            # naive path at the smallest context: dequantize the pages, then bf16 SDPA
            if ctx == contexts[0] and not args.no_naive and fmt == formats[0]:

                def naive(st=st, lay=lay):
                    kd, vd = dequantize_pages(
                        st["cache"],
                        st["block_table"].reshape(-1),
                        lay,
                        backend="torch" if cpu else "triton",
                    )
                    kd = (
                        kd.view(B, -1, HKV, N, D)
                        .permute(0, 2, 1, 3, 4)
                        .reshape(B, HKV, -1, D)[:, :, : st["seq_len"]]
                    )
                    vd = (
                        vd.view(B, -1, HKV, N, D)
                        .permute(0, 2, 1, 3, 4)
                        .reshape(B, HKV, -1, D)[:, :, : st["seq_len"]]
                    )
                    return torch.nn.functional.scaled_dot_product_attention(
                        st["query"].unsqueeze(2),
                        kd.to(torch.bfloat16),
                        vd.to(torch.bfloat16),
                        scale=scale,
                        enable_gqa=True,
                    )

                try:
                    ms = timed(naive)
                    record(ctx, "naive_dequant_sdpa", fmt, ms, st["bytes"])
                except Exception as e:
                    results.append(
                        dict(
                            context=ctx,
                            method="naive_dequant_sdpa",
                            format=fmt,
                            error=f"{type(e).__name__}: {e}"[:300],
                        )
                    )
            del st
            free()

    fused4 = [
        r["gbps"]
        for r in results
        if r.get("method") == "kivi_fused_triton" and r.get("format") == "kivi_4bit" and "gbps" in r
    ]
    summary = {
        "target_gbps_kivi_4bit": TARGET_4BIT_GBPS,
        "kivi_4bit_min_gbps": min(fused4) if fused4 else None,
        "kivi_4bit_max_gbps": max(fused4) if fused4 else None,
        "target_met_all_contexts": bool(fused4) and min(fused4) >= TARGET_4BIT_GBPS and not cpu,
        "tuned_config": best,
    }
    print(f"summary: {summary}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(info=info, check=check, tuning=tuning, results=results, summary=summary),
                f,
                indent=1,
            )
        print(f"wrote {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------
def _compile_only(args) -> int:
    """AOT-compile the fused decode/prefill kernel for ``sm_<arch>`` and print resource usage.

    Best effort (uses ``triton.compiler.ASTSource``, whose signature format is internal): pointer
    and stride arguments are marked divisible by 16, as the JIT specializes them at run time.
    """
    os.environ.pop("TRITON_INTERPRET", None)
    import re
    import subprocess
    import tempfile

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_accel.kernels import kivi_attention as ka

    fn = ka._kivi_attn_kernel
    ptrs = dict(
        q_ptr="*bf16",
        kc_ptr="*u8",
        vc_ptr="*u8",
        ks_ptr="*fp16",
        kz_ptr="*fp16",
        vs_ptr="*fp16",
        vz_ptr="*fp16",
        sk_ptr="*bf16",
        sv_ptr="*bf16",
        tail_ptr="*bf16",
        bt_ptr="*i32",
        seq_lens_ptr="*i32",
        qsl_ptr="*i32",
        tail_idx_ptr="*i32",
        o_ptr="*bf16",
        pacc_ptr="*fp32",
        pml_ptr="*fp32",
    )
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    configs = [
        ("decode kivi_4bit", dict(BITS_K=4, BITS_V=4), dict(), 4, 2),
        ("decode kivi_4bit stages3", dict(BITS_K=4, BITS_V=4), dict(), 4, 3),
        ("decode kivi_4bit warps8", dict(BITS_K=4, BITS_V=4), dict(), 8, 2),
        ("decode kivi_4bit block_n32", dict(BITS_K=4, BITS_V=4, BLOCK_N=32), dict(), 4, 3),
        ("decode kivi_4bit unfolded", dict(BITS_K=4, BITS_V=4, FOLD=False), dict(), 4, 2),
        ("decode kivi_2bit", dict(BITS_K=2, BITS_V=2), dict(), 4, 2),
        ("decode kivi_k4v2 (sinks)", dict(BITS_K=4, BITS_V=2, S=4), dict(), 4, 2),
        (
            "prefill kivi_4bit bm64",
            dict(BITS_K=4, BITS_V=4, BLOCK_Q=16, BLOCK_M=64, ONE_SPLIT=True),
            dict(),
            4,
            2,
        ),
        (
            "prefill kivi_4bit bm64 warps8",
            dict(BITS_K=4, BITS_V=4, BLOCK_Q=16, BLOCK_M=64, ONE_SPLIT=True),
            dict(),
            8,
            2,
        ),
    ]
    failures = 0
    for label, over, _, warps, stages in configs:
        ce = dict(
            N=128,
            G=64,
            D=128,
            DP=128,
            BITS_K=4,
            BITS_V=4,
            VG=128,
            S=0,
            PAGE_RESIDUAL=False,
            QPK=4,
            BLOCK_Q=1,
            BLOCK_M=16,
            BLOCK_N=64,
            ONE_SPLIT=False,
            DOT_F32=False,
            DT=tl.bfloat16,
            FOLD=True,
        )
        ce.update(over)
        sig = {}
        for name in fn.arg_names:
            sig[name] = (
                "constexpr"
                if name in ce
                else ptrs.get(name, "fp32" if name == "qk_scale" else "i32")
            )
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, nm in enumerate(fn.arg_names)
            if sig[nm].startswith("*") or (nm.startswith("s_") and sig[nm] == "i32")
        }
        try:
            k = triton.compile(
                ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs),
                target=GPUTarget("cuda", args.arch, 32),
                options=dict(num_warps=warps, num_stages=stages),
            )
        except Exception as e:
            failures += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e)[:800]}")
            continue
        usage = ""
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            try:
                out = subprocess.run(
                    [tool, "--dump-resource-usage", f.name], capture_output=True, text=True
                ).stdout
                m = re.search(r"REG:(\d+) STACK:(\d+)", out)
                usage = f"regs={m.group(1)} stack={m.group(2)}" if m else out.strip()[-120:]
            except OSError as e:
                usage = f"(cuobjdump unavailable: {e})"
        n_async = k.asm["ptx"].count("cp.async.cg") + k.asm["ptx"].count("cp.async.ca")
        print(
            f"OK   {label:32s} warps={warps} stages={stages} {usage} "
            f"shared={k.metadata.shared} B cp.async={n_async}"
        )
    return 1 if failures else 0


def _triton_version():
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


def _kivi_bytes(lay, B, HQ, HKV, seq_len) -> int:
    """Bytes the fused decode kernel must read (and write) for one step."""
    g, n, d = lay.key_group, lay.block_size, lay.head_size
    lq = (seq_len // g) * g
    rem = seq_len - lq
    pages = -(-seq_len // n)
    per_head = (
        lq * lay.k_row_bytes
        + (lq // g) * d * 4  # packed keys + per-channel scale/zero rows
        + rem * d * lay.dtype_bytes  # tail rows
        + seq_len * (lay.v_row_bytes + 4 * lay.value_groups_per_token)  # packed values + scale/zero
        + pages * lay.sink_tokens * d * lay.dtype_bytes * 2  # sink copies
    )
    return B * HKV * per_head + B * pages * 4 + 2 * B * HQ * d * 2


def _sdpa_backends(torch, cpu):
    if cpu:
        return [("sdpa_cpu", None)]
    from torch.nn.attention import SDPBackend

    return [("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)]


def _time_sdpa(torch, timed, q, k, v, scale, backend):
    """(ms, extra) for one SDPA backend; GQA natively if the backend takes it, else K/V expanded."""
    import contextlib

    F = torch.nn.functional
    ctx = contextlib.nullcontext
    if backend is not None:
        from torch.nn.attention import sdpa_kernel

        ctx = lambda: sdpa_kernel([backend])  # noqa: E731
    rep = q.shape[1] // k.shape[1]
    try:
        with ctx():
            F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
            return timed(
                lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
            ), {"gqa": "native"}
    except Exception as e:
        first = f"{type(e).__name__}: {e}"
    expanded_bytes = 2 * rep * k.numel() * k.element_size()
    if expanded_bytes > 40e9:
        return None, {
            "error": f"native: {first[:200]} | expanded K/V ({expanded_bytes / 1e9:.0f} GB) skipped"
        }
    try:
        ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        with ctx():
            ms = timed(lambda: F.scaled_dot_product_attention(q, ke, ve, scale=scale))
        # the kernel reads the expanded K/V: count those bytes
        return ms, {"gqa": "expanded", "bytes_factor": rep, "native_error": first[:200]}
    except Exception as e:
        return None, {"error": f"native: {first[:150]} | expanded: {type(e).__name__}: {e}"[:400]}


def _check(
    torch, KiviLayout, quantize_on_write, kivi_paged_attention, dev, formats, HQ, HKV, D, N, scale
):
    """Real data at a small shape: fused Triton vs torch reference, Triton write vs torch write."""
    out = {}
    g = torch.Generator(device=dev).manual_seed(1)
    lens = [N * 3 + 17, N + 5, 70, N * 2] if dev.type == "cuda" else [N + 17, 21, 70, N]
    for fmt in formats:
        lay = KiviLayout.preset(fmt, head_size=D, block_size=N)
        caches = {}
        pages = [-(-L // N) for L in lens]
        nb = sum(pages)
        perm = torch.randperm(nb, device=dev, generator=g)
        bt = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=dev)
        used = 0
        keys, vals = [], []
        for i, L in enumerate(lens):
            bt[i, : pages[i]] = perm[used : used + pages[i]].to(torch.int32)
            used += pages[i]
            k = torch.randn(L, HKV, D, device=dev, generator=g)
            k[:, :, 7] = k[:, :, 7] * 10 + 3
            keys.append(k.to(torch.bfloat16))
            vals.append(torch.randn(L, HKV, D, device=dev, generator=g).to(torch.bfloat16))
        for backend in ("torch", "triton"):
            cache = lay.allocate(nb, HKV, device=dev)
            tail = lay.allocate_tail(2 * len(lens), HKV, device=dev)
            for i, L in enumerate(lens):
                pos = torch.arange(L, device=dev)
                slots = bt[i].long()[pos // N] * N + pos % N
                tm = 2 * i + (pos // lay.key_group) % 2
                quantize_on_write(
                    keys[i],
                    vals[i],
                    cache,
                    slots,
                    lay,
                    k_tail=tail,
                    tail_mapping=tm,
                    backend=backend,
                )
            caches[backend] = (cache, tail)
        diff = (caches["triton"][0] != caches["torch"][0]).float().mean().item()
        cache, tail = caches["torch"]
        tail_index = torch.tensor(
            [2 * i + (L // lay.key_group) % 2 for i, L in enumerate(lens)], device=dev
        )
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        qlens = [1, 1, 5, 1]
        qsl = torch.tensor(
            [0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=dev
        )
        q = torch.randn(sum(qlens), HQ, D, device=dev, generator=g).to(torch.bfloat16)
        args = (q, cache, bt, sl, qsl, scale, lay)
        ref = kivi_paged_attention(
            *args, k_tail=tail, tail_index=tail_index, backend="torch"
        ).float()
        res = {"write_bytes_differing_frac": diff}
        for fold in (True, False):
            try:
                o = kivi_paged_attention(
                    *args, k_tail=tail, tail_index=tail_index, backend="triton", fold=fold
                ).float()
                res[f"fused_fold{int(fold)}_max_abs_err_vs_torch"] = float((o - ref).abs().max())
            except Exception as e:
                res[f"fused_fold{int(fold)}_error"] = f"{type(e).__name__}: {e}"[:300]
        # error of the format itself vs bf16 attention on the unquantized K/V
        exact = []
        for i, L in enumerate(lens):
            qq = q[qsl[i] : qsl[i + 1]].float().transpose(0, 1).unsqueeze(0)
            kk = keys[i].float().transpose(0, 1).unsqueeze(0)
            vv = vals[i].float().transpose(0, 1).unsqueeze(0)
            lq = qlens[i]
            mask = (
                torch.arange(L, device=dev)[None, :] <= torch.arange(L - lq, L, device=dev)[:, None]
            )
            exact.append(
                torch.nn.functional.scaled_dot_product_attention(
                    qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True
                )[0].transpose(0, 1)
            )
        exact = torch.cat(exact)
        res["format_rel_err_vs_bf16"] = float((ref - exact).norm() / exact.norm())
        out[fmt] = res
    return out


if __name__ == "__main__":
    sys.exit(main())
