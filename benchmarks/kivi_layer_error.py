"""Per-layer attention-output error of KV formats on a real model's q/k/v: why per-channel keys win.

Input: the q/k/v of every attention layer of one held-out window, dumped by
``kivi_fakequant_hf.py --dump DIR`` (post-RoPE keys, the model's own dtype). For each layer and
format, ``kivi_format.attention_error`` quantizes K/V as the format stores them and compares
fp32 causal attention on them with attention on the unquantized K/V (relative Frobenius error of
the output). Formats: ``kivi_4bit`` (keys per channel over 64-token groups), the same with its
values Hadamard-rotated before quantization (``kv_quant.value_rotation``), the same bits with
keys per token (``key_mode="token"``: only the key axis changes), ``int4_per_token`` (vLLM's
int4_per_token_head without its Hadamard rotation), ``int4_per_token_head`` (vLLM's format as it
is, rotation included: ``kernels/int4_per_token_head_ref.py``), ``int8_per_token`` and
``kivi_2bit``. The
``outlier`` column is the layer's largest key channel (mean |k| over tokens and heads) over the
median channel.

    .venv/bin/python benchmarks/kivi_fakequant_hf.py --model DIR --count 1 --formats bf16 \\
        --dtype float32 --dump /tmp/qkv
    .venv/bin/python benchmarks/kivi_layer_error.py /tmp/qkv/qkv.pt [--json out.json] \\
        [--split kivi_2bit]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

FORMATS = (  # label, fake_quant_kv format (a preset, or a preset with layout overrides), key_mode
    ("kivi_4bit", "kivi_4bit", "channel"),
    ("kivi_4bit_v_hadamard", ("kivi_4bit", {"value_rotation": "hadamard"}), "channel"),
    ("4bit_keys_per_token", "kivi_4bit", "token"),
    ("int4_per_token", "int4_per_token", "channel"),
    ("int4_per_token_head", "int4_per_token_head", "channel"),
    ("int8_per_token", "int8_per_token", "channel"),
    ("kivi_2bit", "kivi_2bit", "channel"),
)


def outlier_ratio(k: torch.Tensor) -> float:
    """Largest key channel over the median channel (mean |k| per channel, ``k [L, H, D]``)."""
    per_channel = k.float().abs().mean(dim=(0, 1))
    return float(per_channel.max() / per_channel.median())


def layer_errors(dump: list) -> list[dict]:
    from vllm_accel.kernels.kivi_format import KiviLayout, attention_error

    rows = []
    for layer, (q, k, v, scale) in enumerate(dump):
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, L, D] -> [L, H, D]
        row = {"layer": layer, "outlier": outlier_ratio(k)}
        for label, fmt, key_mode in FORMATS:
            if isinstance(fmt, tuple):  # bf16 rows, 128-token pages, as a preset name gets
                fmt = KiviLayout.preset(fmt[0], head_size=k.shape[-1], **fmt[1])
            row[label] = attention_error(q, k, v, fmt, key_mode=key_mode, scale=scale)["out_rel"]
        rows.append(row)
    return rows


def split_errors(dump: list, preset: str) -> dict[str, float]:
    """Mean attention-output error of ``preset`` (values rotated, the default) with only the keys
    quantized and with only the values quantized: which of the two carries the error."""
    from vllm_accel.kernels.kivi_format import KiviLayout, fake_quant_kv, reference_attention

    sums = {"keys_only": 0.0, "values_only": 0.0}
    for q, k, v, scale in dump:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        layout = KiviLayout.preset(preset, head_size=k.shape[-1], value_rotation="hadamard")
        kq, vq = fake_quant_kv(k, v, layout)
        ref = reference_attention(q, k, v, scale=scale)
        for name, (kk, vv) in {"keys_only": (kq, v), "values_only": (k, vq)}.items():
            out = reference_attention(q, kk, vv, scale=scale)
            sums[name] += float((out - ref).norm() / ref.norm())
    return {name: total / len(dump) for name, total in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dump", help="qkv.pt written by kivi_fakequant_hf.py --dump")
    ap.add_argument("--json", default=None)
    ap.add_argument("--split", default=None, metavar="PRESET",
                    help="also print PRESET's (e.g. kivi_2bit) mean error with only the keys and "
                    "with only the values quantized")
    args = ap.parse_args()
    dump = torch.load(args.dump)
    if args.split:
        print(args.split, {k: round(v, 4) for k, v in split_errors(dump, args.split).items()})
    rows = layer_errors(dump)
    labels = [label for label, _, _ in FORMATS]
    print("layer  outlier  " + "  ".join(f"{label:>19s}" for label in labels))
    for r in rows:
        print(f"{r['layer']:5d}  {r['outlier']:6.1f}x  "
              + "  ".join(f"{r[label]:19.4f}" for label in labels))
    means = {label: sum(r[label] for r in rows) / len(rows) for label in labels}
    print("mean           " + "  ".join(f"{means[label]:19.4f}" for label in labels))
    if args.json:
        Path(args.json).write_text(json.dumps({"layers": rows, "mean": means}, indent=1))


if __name__ == "__main__":
    main()
