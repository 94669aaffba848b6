"""Perplexity of the KIVI formats by fake quantization in HF transformers (no vLLM).

Every attention layer sees its post-RoPE keys and values passed through
``kivi_format.fake_quant_kv`` (exactly what the paged cache returns for a single-chunk prefill:
complete key groups quantized per channel, the unfinished group in full precision, values per
token).  Windows are the same held-out windows as ``vllm_accel.quality.perplexity``.

``--semantics decode`` scores every position as a decode step of the engine sees it instead:
query ``i`` reads quantized keys only of the groups complete by position ``i`` (the rest from
the full-precision residual) and quantized values -- no key group's scale carries information
from tokens after ``i``, which single-chunk prefill semantics allows (the group is quantized
with its later tokens' min/max before the earlier tokens' queries attend to it).

    flock /tmp/cpu.lock .venv/bin/python benchmarks/kivi_fakequant_hf.py \
        --model ~/.cache/vllm-accel/models/qwen2.5-coder-0.5b-instruct --window 1024 --count 2

``--dump DIR`` saves q/k/v of every layer for the first window (for kernel-level checks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch

MODE = {"fmt": "bf16", "key_group": None, "value_rotation": "none", "dump": None, "fp32": False,
        "semantics": "prefill", "value_residual": False}


def _decode_semantics_attention(query, k, kq, vq, key_group, scaling, v=None):
    """fp32 causal attention where query ``i`` sees key ``j`` quantized iff j's key group ends at
    or before ``i`` (what a decode step at ``i`` reads after writing its own token), values
    quantized; with ``v`` (unquantized values) the values of the unfinished group are read
    from ``v`` as well (a value residual, as KIVI's reference code keeps; not in this format).
    ``query [1, Hq, L, D]``; ``k, kq, vq, v [L, H_kv, D]``."""
    q = query[0].float()
    rep = q.shape[0] // k.shape[1]
    exact_k, quant_k, quant_v = (
        t.float().transpose(0, 1).repeat_interleave(rep, 0) for t in (k, kq, vq))
    pos = torch.arange(k.shape[0])
    i, j = pos[:, None], pos[None, :]
    quantized = (j // key_group + 1) * key_group - 1 <= i
    s = torch.where(quantized, q @ quant_k.transpose(1, 2), q @ exact_k.transpose(1, 2))
    s = (s * scaling).masked_fill(j > i, float("-inf"))
    p = torch.softmax(s, -1)
    if v is None:
        out = p @ quant_v
    else:
        exact_v = v.float().transpose(0, 1).repeat_interleave(rep, 0)
        out = (p * quantized) @ quant_v + (p * ~quantized) @ exact_v
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype)


def _fq_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from vllm_accel.kernels.kivi_format import KiviLayout, fake_quant_kv

    fmt = MODE["fmt"]
    if MODE["dump"] is not None:
        MODE["dump"].append((query[0].detach().clone(), key[0].detach().clone(),
                             value[0].detach().clone(), float(scaling)))
    if fmt != "bf16":
        k = key[0].transpose(0, 1)  # [L, H, D]
        v = value[0].transpose(0, 1)
        if fmt.startswith("kivi"):
            over = {"value_rotation": MODE["value_rotation"]}
            if MODE["key_group"]:
                over["key_group"] = MODE["key_group"]
            layout = KiviLayout.preset(fmt, head_size=k.shape[-1], block_size=128,
                                       dtype=key.dtype, **over)
            kq, vq = fake_quant_kv(k, v, layout)
            if MODE["semantics"] == "decode":
                v_residual = v if MODE["value_residual"] else None
                return _decode_semantics_attention(query, k, kq, vq, layout.key_group,
                                                   scaling, v_residual), None
        else:
            kq, vq = fake_quant_kv(k, v, fmt)
        cast = torch.float32 if MODE["fp32"] else key.dtype
        key = kq.to(cast).transpose(0, 1).unsqueeze(0)
        value = vq.to(cast).transpose(0, 1).unsqueeze(0)
    if MODE["fp32"]:
        dt = query.dtype
        query, key, value = query.float(), key.float(), value.float()
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        out, w = sdpa_attention_forward(module, query, key, value, attention_mask,
                                        dropout=dropout, scaling=scaling, **kw)
        return out.to(dt), w
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--count", type=int, default=2)
    ap.add_argument("--formats", default="bf16,kivi_4bit,kivi_2bit",
                    help="comma-separated kivi_format.fake_quant_kv names: bf16 (unquantized), "
                    "kivi_4bit, kivi_2bit, int4_per_token_head (vLLM's format), int4_per_token, "
                    "int8_per_token")
    ap.add_argument("--key-group", type=int, default=0)
    ap.add_argument("--value-rotation", choices=("none", "hadamard"), default="none",
                    help="KIVI formats: kv_quant.value_rotation")
    ap.add_argument("--semantics", choices=("prefill", "decode"), default="prefill")
    ap.add_argument("--value-residual", action="store_true",
                    help="decode semantics: read the values of each query's unfinished key group "
                    "unquantized too (a what-if: the format quantizes values on write)")
    ap.add_argument("--dump", default=None)
    ap.add_argument("--dump-format", default="bf16")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="model dtype (the format named bf16 is then the unquantized float32 "
                    "cache)")
    ap.add_argument("--fp32-attention", action="store_true",
                    help="attention in fp32 on (dequantized) K/V, like the KIVI torch kernel")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))

    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from vllm_accel.quality.perplexity import build_windows, prediction_agreement

    AttentionInterface.register("kivi_fq", _fq_attention)
    path = os.path.expanduser(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype),
                                                 attn_implementation="kivi_fq").eval()
    windows = build_windows(tok, args.window, args.count)
    MODE["key_group"] = args.key_group or None
    MODE["value_rotation"] = args.value_rotation
    MODE["fp32"] = args.fp32_attention
    MODE["semantics"] = args.semantics
    MODE["value_residual"] = args.value_residual
    res, predictions = {}, {}
    for fmt in args.formats.split(","):
        MODE["fmt"] = fmt
        nll, n = 0.0, 0
        predictions[fmt] = []
        for wi, w in enumerate(windows):
            if args.dump and fmt == args.dump_format and wi == 0:
                MODE["dump"] = []
            ids = torch.tensor([w])
            with torch.no_grad():
                logits = model(ids, use_cache=False).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            nll -= float(lp.sum())
            n += lp.numel()
            predictions[fmt].append({"logprobs": [None, *lp.tolist()],
                                     "top1": [None, *logits[:-1].argmax(-1).tolist()]})
            if MODE["dump"] is not None:
                Path(args.dump).mkdir(parents=True, exist_ok=True)
                torch.save(MODE["dump"], Path(args.dump) / "qkv.pt")
                MODE["dump"] = None
        res[fmt] = math.exp(nll / n)
        print(json.dumps({"fmt": fmt, "ppl": res[fmt], "tokens": n}), flush=True)
    first = next(iter(res))
    print(f"vs {first}, {args.semantics} semantics:")
    for fmt, p in res.items():
        agree = prediction_agreement(predictions[first], predictions[fmt])
        print(f"{fmt:12s} ppl {p:.4f} {100 * (p / res[first] - 1):+.2f} %  top-1 agree "
              f"{100 * agree['top1_agreement']:5.1f} %  |dlogp| "
              f"{agree['mean_abs_logprob_delta']:.3f}")


if __name__ == "__main__":
    main()
