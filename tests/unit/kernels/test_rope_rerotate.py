"""Re-rotating RoPE keys by delta == applying RoPE at the shifted positions (torch + Triton)."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

from vllm_accel.kernels import rope_rerotate
from vllm_accel.kernels.rope_rerotate import apply_rope, rerotate_keys, rope_cos_sin_cache

from .conftest import requires_triton_interpreter

# the torch path, and the Triton kernel in the CPU interpreter
BACKENDS = ["torch", pytest.param("triton", marks=requires_triton_interpreter)]

N, H, MAX_POS = 12, 3, 2048
# (head_dim, rotary_dim): full rotary, partial rotary, and a half width that is not a power of 2
DIMS = [(32, 32), (32, 16), (24, 12)]
STYLES = [pytest.param(True, id="neox"), pytest.param(False, id="gptj")]
DELTAS = ["pos", "neg", "zero", "per_token"]


def _case(head_dim, rotary_dim, delta_kind, seed=0, dtype=torch.float32):
    """Pre-RoPE keys [N, H, D], positions p (a chunk starting at a random offset), delta."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(N, H, head_dim, generator=g) * 2).to(dtype)
    positions = 300 + torch.arange(N)
    if delta_kind == "pos":
        delta = 517
    elif delta_kind == "neg":
        delta = -283
    elif delta_kind == "zero":
        delta = 0
    else:  # per token, both signs, p + d >= 0
        delta = torch.randint(-300, 1500, (N,), generator=g)
        delta[0], delta[1] = 0, -300
    cache = rope_cos_sin_cache(rotary_dim, MAX_POS)
    return k, positions, delta, cache


def _scale(x):
    return float(x.float().abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("delta_kind", DELTAS)
@pytest.mark.parametrize("neox", STYLES)
@pytest.mark.parametrize("head_dim,rotary_dim", DIMS)
def test_rerotate_equals_rope_at_shifted_positions(head_dim, rotary_dim, neox, delta_kind,
                                                   backend):
    k, p, d, cache = _case(head_dim, rotary_dim, delta_kind)
    stored = apply_rope(k, p, cache, rotary_dim, neox)
    moved = rerotate_keys(stored, d, cache, rotary_dim, neox, backend=backend)
    expected = apply_rope(k, p + d, cache, rotary_dim, neox)
    assert moved.dtype == torch.float32 and moved.shape == k.shape
    torch.testing.assert_close(moved, expected, atol=1e-5 * _scale(k), rtol=0)
    # the pass-through dims are the stored bits
    assert torch.equal(moved[..., rotary_dim:], stored[..., rotary_dim:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("neox", STYLES)
def test_check_can_fail(neox, backend):
    """The comparison above is sensitive: the wrong sign, or the other pairing, is far off."""
    k, p, _, cache = _case(32, 32, "pos")
    stored = apply_rope(k, p, cache, None, neox)
    expected = apply_rope(k, p + 517, cache, None, neox)
    for wrong in (rerotate_keys(stored, -517, cache, is_neox_style=neox, backend=backend),
                  rerotate_keys(stored, 517, cache, is_neox_style=not neox, backend=backend)):
        assert (wrong - expected).abs().max() > 0.1 * _scale(k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("neox", STYLES)
def test_zero_delta_is_identity(neox, backend):
    k, p, _, cache = _case(32, 16, "zero")
    stored = apply_rope(k, p, cache, 16, neox)
    assert torch.equal(rerotate_keys(stored, 0, cache, 16, neox, backend=backend), stored)
    assert torch.equal(rerotate_keys(stored, torch.zeros(N, dtype=torch.int32), cache, 16, neox,
                                     backend=backend), stored)


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip(backend):
    k, p, d, cache = _case(32, 32, "per_token")
    stored = apply_rope(k, p, cache)
    back = rerotate_keys(rerotate_keys(stored, d, cache, backend=backend), -d, cache,
                         backend=backend)
    torch.testing.assert_close(back, stored, atol=1e-5 * _scale(k), rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("neox", STYLES)
def test_half_precision(neox, dtype, backend):
    k, p, d, cache = _case(32, 16, "per_token", dtype=dtype)
    stored = apply_rope(k, p, cache, 16, neox)
    assert stored.dtype == dtype
    moved = rerotate_keys(stored, d, cache, 16, neox, backend=backend)
    assert moved.dtype == dtype
    eps = torch.finfo(dtype).eps
    expected = apply_rope(k, p + d, cache, 16, neox)
    torch.testing.assert_close(moved.float(), expected.float(), atol=4 * eps * _scale(k),
                               rtol=0)
    # computed in float32, rounded once (the Triton interpreter rounds bf16 towards zero, not
    # to nearest as compiled Triton does: allow it one ulp)
    ref32 = rerotate_keys(stored.float(), d, cache, 16, neox, backend="torch").to(dtype)
    if backend == "torch" or dtype == torch.float16:
        assert torch.equal(moved, ref32)
    else:
        torch.testing.assert_close(moved, ref32, atol=0, rtol=eps)
    assert torch.equal(moved[..., 16:], stored[..., 16:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("neox", STYLES)
def test_half_precision_cache(neox, backend):
    """A cache kept in the model dtype (as vLLM does) is read and widened to float32."""
    k, p, d, cache = _case(32, 32, "neg")
    stored = apply_rope(k, p, cache, None, neox)
    cache16 = cache.to(torch.bfloat16)
    moved = rerotate_keys(stored, d, cache16, is_neox_style=neox, backend=backend)
    expected = rerotate_keys(stored, d, cache16.float(), is_neox_style=neox, backend="torch")
    torch.testing.assert_close(moved, expected, atol=1e-6 * _scale(k), rtol=0)


def _strided(k):
    """``k [N, H, D]`` as a non-contiguous view: heads-major storage, padded head dim."""
    n, h, dd = k.shape
    base = torch.full((h, n, dd + 5), float("nan"), dtype=k.dtype)
    view = base.transpose(0, 1)[..., 2 : 2 + dd]
    view.copy_(k)
    assert not view.is_contiguous()
    return base, view


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("neox", STYLES)
def test_strided_input_and_output(neox, backend):
    k, p, d, cache = _case(32, 16, "per_token")
    stored = apply_rope(k, p, cache, 16, neox)
    _, view = _strided(stored)
    moved = rerotate_keys(view, d, cache, 16, neox, backend=backend)
    dense = rerotate_keys(stored, d, cache, 16, neox, backend=backend)
    assert torch.equal(moved, dense)
    torch.testing.assert_close(moved, apply_rope(k, p + d, cache, 16, neox),
                               atol=1e-5 * _scale(k), rtol=0)
    # into a strided ``out`` (pass-through dims copied, padding untouched)
    out_base, out_view = _strided(torch.zeros_like(stored))
    res = rerotate_keys(view, d, cache, 16, neox, out=out_view, backend=backend)
    assert res is out_view
    assert torch.equal(out_view, dense)
    assert torch.isnan(out_base[..., :2]).all() and torch.isnan(out_base[..., 34:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_in_place(rotary_dim, backend):
    k, p, d, cache = _case(32, rotary_dim, "per_token")
    stored = apply_rope(k, p, cache, rotary_dim)
    expected = rerotate_keys(stored, d, cache, rotary_dim, backend=backend)
    # contiguous
    keys = stored.clone()
    assert rerotate_keys(keys, d, cache, rotary_dim, out=keys, backend=backend) is keys
    assert torch.equal(keys, expected)
    # a strided view of a larger buffer: only the view's elements change
    base, view = _strided(stored)
    rerotate_keys(view, d, cache, rotary_dim, out=view, backend=backend)
    assert torch.equal(view, expected)
    assert torch.isnan(base[..., :2]).all() and torch.isnan(base[..., 34:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_dim_keys_and_scalar_tensor_delta(backend):
    k, p, _, cache = _case(32, 32, "pos")
    stored = apply_rope(k, p, cache)
    flat = stored[:, 1]  # [N, D], strided
    moved = rerotate_keys(flat, torch.tensor(517), cache, backend=backend)
    assert moved.shape == flat.shape
    assert torch.equal(moved, rerotate_keys(stored, 517, cache, backend=backend)[:, 1])


@pytest.mark.parametrize("delta_kind", DELTAS)
@pytest.mark.parametrize("neox", STYLES)
@pytest.mark.parametrize("head_dim,rotary_dim", DIMS)
@requires_triton_interpreter
def test_triton_equals_torch(head_dim, rotary_dim, neox, delta_kind):
    k, p, d, cache = _case(head_dim, rotary_dim, delta_kind, seed=1)
    stored = apply_rope(k, p, cache, rotary_dim, neox)
    a = rerotate_keys(stored, d, cache, rotary_dim, neox, backend="torch")
    b = rerotate_keys(stored, d, cache, rotary_dim, neox, backend="triton")
    torch.testing.assert_close(b, a, atol=1e-6 * _scale(k), rtol=0)
    assert torch.equal(b[..., rotary_dim:], stored[..., rotary_dim:])


@requires_triton_interpreter
def test_triton_many_rows():
    """More (token, head) rows than one program's block: several programs, a ragged tail."""
    g = torch.Generator().manual_seed(2)
    n, h, dd = 70, 5, 128
    cache = rope_cos_sin_cache(dd, 256)
    keys = torch.randn(n, h, dd, generator=g)
    d = torch.randint(-255, 256, (n,), generator=g)
    a = rerotate_keys(keys, d, cache, backend="torch")
    b = rerotate_keys(keys, d, cache, backend="triton")
    torch.testing.assert_close(b, a, atol=1e-6 * _scale(keys), rtol=0)


# ---------------------------------------------------------------- the references themselves


def test_cos_sin_cache_layout():
    rd, base = 16, 500.0
    cache = rope_cos_sin_cache(rd, 64, base=base)
    assert cache.shape == (64, rd) and cache.dtype == torch.float32
    assert torch.equal(cache[0], torch.cat([torch.ones(rd // 2), torch.zeros(rd // 2)]))
    for pos, j in [(1, 0), (7, 3), (63, 7)]:
        angle = pos * base ** (-2 * j / rd)
        assert cache[pos, j].item() == pytest.approx(math.cos(angle), abs=1e-7)
        assert cache[pos, rd // 2 + j].item() == pytest.approx(math.sin(angle), abs=1e-7)
    assert rope_cos_sin_cache(rd, 8, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("neox", STYLES)
def test_apply_rope_is_complex_rotation(neox):
    """RoPE as complex multiplication ``(x1 + i x2) * exp(i p theta_j)``, pairs per style."""
    head_dim, rd = 24, 16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, H, head_dim, generator=g, dtype=torch.float64)
    p = torch.randint(0, 100, (N,), generator=g)
    cache = rope_cos_sin_cache(rd, 100, dtype=torch.float64)
    theta = 10000.0 ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    rot = torch.polar(torch.ones(N, 1, rd // 2, dtype=torch.float64),
                      p[:, None, None].double() * theta)
    if neox:
        z = torch.complex(x[..., : rd // 2], x[..., rd // 2 : rd]) * rot
        expected_rot = torch.cat([z.real, z.imag], -1)
    else:
        z = torch.view_as_complex(x[..., :rd].reshape(N, H, rd // 2, 2).contiguous()) * rot
        expected_rot = torch.view_as_real(z).reshape(N, H, rd)
    got = apply_rope(x.float(), p, cache, rd, neox)
    torch.testing.assert_close(got[..., :rd].double(), expected_rot, atol=1e-5, rtol=0)
    assert torch.equal(got[..., rd:], x[..., rd:].float())


def test_doctests():
    assert doctest.testmod(rope_rerotate).failed == 0


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("delta", [MAX_POS, -MAX_POS, MAX_POS + 7, "tensor"])
def test_delta_out_of_cache(delta):
    k, p, _, cache = _case(32, 32, "pos")
    if delta == "tensor":
        delta = torch.zeros(N, dtype=torch.long)
        delta[5] = -MAX_POS
    with pytest.raises(ValueError, match=f"max_position = {MAX_POS}"):
        rerotate_keys(k, delta, cache)
    # the largest shift the cache holds is fine
    rerotate_keys(k, MAX_POS - 1, cache)
    rerotate_keys(k, -(MAX_POS - 1), cache)


@pytest.mark.parametrize("rotary_dim", [15, 33, 0, -2])
def test_bad_rotary_dim(rotary_dim):
    k = torch.randn(N, H, 32)
    cache = torch.zeros(MAX_POS, abs(rotary_dim))
    with pytest.raises(ValueError, match="rotary_dim"):
        rerotate_keys(k, 1, cache, rotary_dim)


def test_bad_inputs():
    k = torch.randn(N, H, 32)
    cache = rope_cos_sin_cache(32, MAX_POS)
    with pytest.raises(ValueError, match="backend"):
        rerotate_keys(k, 1, cache, backend="cuda")
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_cos_sin_cache(7, 16)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rerotate_keys(k, 1, cache, rotary_dim=16)  # cache built for 32
    with pytest.raises(ValueError, match="shape"):
        rerotate_keys(k, torch.zeros(N + 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="integer"):
        rerotate_keys(k, torch.zeros(N), cache)
    with pytest.raises(ValueError, match="int"):
        rerotate_keys(k, 1.5, cache)
    with pytest.raises(ValueError, match="out"):
        rerotate_keys(k, 1, cache, out=torch.empty(N, H, 16))
