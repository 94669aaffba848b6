"""Our torch reference of vLLM's ``int4_per_token_head`` against vLLM's own write kernel (run in
the Triton interpreter), and the error it makes against the formats it is compared with."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_accel.kernels.int4_per_token_head_ref import (
    fake_quant_int4_per_token_head,
    quant_dequant_rows,
    rht,
)
from vllm_accel.kernels.kivi_format import attention_error, fake_quant_kv

_VLLM_WRITE = """
import sys, torch, triton, triton.language as tl
import vllm.triton_utils as vtu
vtu.triton, vtu.tl = triton, tl  # vLLM's CPU build disables Triton; the interpreter runs it
from vllm.v1.attention.ops import int4_per_token_head as mod
k, v, block = torch.load(sys.argv[1])
t, h, d = k.shape
caches = [torch.zeros(2, block, h, d // 2, dtype=torch.uint8) for _ in range(2)]
scales = [torch.zeros(2, block, h) for _ in range(2)]
mod.reshape_and_cache_int4(k, v, *caches, torch.arange(t), k_scale_cache=scales[0],
                           v_scale_cache=scales[1])
torch.save((caches, scales, mod.single_rht(k.float())), sys.argv[1])
"""


def _vllm_write(k, v, block, tmp_path):
    """vLLM's own int4 write kernel on ``k, v``, in a subprocess (patching vLLM's Triton switch
    must not leak into this test process)."""
    pytest.importorskip("vllm")
    pytest.importorskip("triton")
    path = tmp_path / "kv.pt"
    torch.save((k, v, block), path)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _VLLM_WRITE, str(path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(path)


def _unpack(cache: torch.Tensor, scales: torch.Tensor, t: int) -> torch.Tensor:
    """Dequantize vLLM's packed rows as its attention kernel does: low nibble = even channel,
    zero point in the scale's low 4 bits, the scale read with those bits cleared."""
    h, half = cache.shape[2], cache.shape[3]
    c = cache.reshape(-1, h, half)[:t]
    s = scales.reshape(-1, h)[:t]
    codes = torch.stack([(c & 0xF).float(), (c >> 4).float()], -1).reshape(t, h, 2 * half)
    bits = s.view(torch.int32)
    zp = (bits & 0xF).float()
    return (codes - zp[..., None]) * (bits & -16).view(torch.float32)[..., None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 80])
def test_reference_matches_vllms_write_kernel(dtype, head_size, tmp_path):
    torch.manual_seed(0)
    t, h, block = 20, 2, 16
    k = torch.randn(t, h, head_size).to(dtype)
    v = (3 * torch.randn(t, h, head_size)).to(dtype)
    k[:, :, 5] += 20  # an outlier channel
    (kc, vc), (ks, vs), k_rotated = _vllm_write(k, v, block, tmp_path)
    assert torch.allclose(rht(k), k_rotated, atol=1e-4)
    for x, cache, scales in ((k, kc, ks), (v, vc, vs)):
        ours = quant_dequant_rows(rht(x).to(dtype))
        exact = dtype == torch.bfloat16  # fp32 rows differ in the rotation's rounding only
        torch.testing.assert_close(_unpack(cache, scales, t), ours, atol=0 if exact else 5e-4,
                                   rtol=0)


def test_rotation_helps_with_a_zero_mean_outlier_channel():
    """A channel that is large but centred (unlike Qwen's bias-like outliers, where the
    rotation hurts: docs/kv_quant.md) is what the rotation is for."""
    torch.manual_seed(1)
    q, k, v = torch.randn(16, 4, 64), torch.randn(128, 2, 64), torch.randn(128, 2, 64)
    k[:, :, 3] *= 30
    rotated = attention_error(q, k, v, "int4_per_token_head")
    plain = attention_error(q, k, v, "int4_per_token")
    assert rotated["k_rel"] < 0.5 * plain["k_rel"]
    assert rotated["out_rel"] < plain["out_rel"]


def test_fake_quant_kv_accepts_the_name():
    k, v = torch.randn(10, 2, 64), torch.randn(10, 2, 64)
    kq, vq = fake_quant_kv(k, v, "int4_per_token_head")
    assert torch.equal(kq, fake_quant_int4_per_token_head(k))
    assert torch.equal(vq, fake_quant_int4_per_token_head(v))
    assert 0 < float((vq - v).norm() / v.norm()) < 0.15
