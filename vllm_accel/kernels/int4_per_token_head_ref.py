"""Torch reference of vLLM 0.32's ``--kv-cache-dtype int4_per_token_head``, for quality studies.

vLLM's format runs only in its Triton GPU kernels; the issue asks KIVI to be compared with it on
the CPU through "the same format computed by our reference".  What vLLM stores
(``vllm/v1/attention/ops/int4_per_token_head.py``, read for this module, not copied):

* keys and values (post-RoPE) are multiplied by a randomized Hadamard transform
  ``x -> H (s * x)`` per (token, head): ``s`` a fixed +-1 sign vector, ``H`` the unnormalized
  Sylvester Hadamard matrix (block-diagonal over blocks of ``b``, the largest power-of-two
  divisor of D, each block with the same ``b`` signs); queries
  get the same transform, so ``q.k`` is unchanged up to the constant norm, which vLLM folds into
  the softmax scale, and the attention output is transformed back;
* each rotated (token, head) row is quantized to 4 bits, asymmetric, with an *integer* zero
  point: ``scale = max((max - min) / 15, 1e-6)``, ``zp = clamp(round(-min / scale), 0, 15)``,
  ``code = clamp(round(x * (1 / scale) + zp), 0, 15)``, ``x_hat = (code - zp) * scale``; rounding is
  half away from zero;
* the fp32 scale carries the zero point in its low 4 mantissa bits (``bits & ~0xF | zp``);
  attention masks them off, so the scale it reads is the written one truncated (slightly smaller
  than the one that chose the codes).

:func:`fake_quant_int4_per_token_head` returns ``x_hat`` rotated back, i.e. the K/V that
attention effectively reads, so studies can use ordinary attention on it.  The sign vector is
drawn as vLLM draws it (``torch.bernoulli`` with the same seed); any fixed sign vector gives the
same error statistics.

>>> x = torch.randn(5, 2, 64)
>>> y = fake_quant_int4_per_token_head(x)
>>> y.shape, bool(((y - x).norm() / x.norm()) < 0.15)
(torch.Size([5, 2, 64]), True)
"""

from __future__ import annotations

import functools

import torch

from vllm_accel.kernels.kivi_format import hadamard_matrix

_SIGN_SEED = 0x9E3779B9  # vLLM's seed of the first RHT round


@functools.lru_cache(maxsize=8)
def rht_signs(d: int) -> torch.Tensor:
    """The +-1 sign vector of length ``d`` vLLM's single RHT uses (float32, CPU)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_SIGN_SEED)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0


def _block(d: int) -> int:
    return d & -d  # the largest power-of-two divisor of d


def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """vLLM's single randomized Hadamard transform over the last dimension, fp32, unnormalized
    (``rht(rht(x), inverse=True) == b * x`` with ``b`` the block size).

    >>> x = torch.randn(3, 48)
    >>> torch.allclose(rht(rht(x), inverse=True) / 16, x, atol=1e-5)
    True
    """
    d = x.shape[-1]
    b = _block(d)
    lead = x.shape[:-1]
    xb = x.float().reshape(*lead, d // b, b)
    h = torch.sign(hadamard_matrix(b, x.device))  # the unnormalized +-1 matrix
    signs = rht_signs(b).to(x.device)  # one sign vector, shared by every block
    if inverse:
        return ((xb @ h) * signs).reshape(*lead, d)
    return ((xb * signs) @ h).reshape(*lead, d)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, torch.floor(x + 0.5), torch.ceil(x - 0.5))


def quant_dequant_rows(x: torch.Tensor) -> torch.Tensor:
    """4-bit asymmetric quantization with an integer zero point of every row of ``x`` (last
    dimension), dequantized as vLLM's attention reads it (the scale without its low 4 bits)."""
    x = x.float()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp_min(1e-6)
    zp = _round_half_away(-lo / scale).clamp(0.0, 15.0)
    codes = _round_half_away(x * (1.0 / scale) + zp).clamp(0.0, 15.0)  # as vLLM: reciprocal
    read = (scale.view(torch.int32) & -16).view(torch.float32)  # zero point's bits masked off
    return (codes - zp) * read


def fake_quant_int4_per_token_head(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` (keys or values) as vLLM's ``int4_per_token_head`` cache gives it back to
    attention: rotated, quantized per row, dequantized, rotated back (fp32)."""
    b = _block(x.shape[-1])
    rotated = rht(x).to(x.dtype)  # vLLM casts the rotated rows back to the model dtype
    return rht(quant_dequant_rows(rotated), inverse=True) / b
