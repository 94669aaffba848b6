"""APE attention (kernels/ape_attention.py) against its definition and ordinary attention."""

from __future__ import annotations

import doctest

import pytest
import torch

from vllm_accel.kernels import ape_attention as ape


def _case(n=5, heads=4, kv_heads=2, dim=16, keys=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=g)
    k = torch.randn(keys, kv_heads, dim, generator=g)
    v = torch.randn(keys, kv_heads, dim, generator=g)
    positions = torch.sort(torch.randperm(keys, generator=g)[:n]).values
    chunk = torch.zeros(keys, dtype=torch.bool)
    chunk[3:12] = True
    chunk[15:30] = True
    return q, k, v, positions, chunk


def test_doctests():
    assert doctest.testmod(ape).failed == 0


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (14, 2)])
def test_unit_temperature_and_scale_is_ordinary_causal_attention(heads, kv_heads):
    q, k, v, positions, chunk = _case(heads=heads, kv_heads=kv_heads)
    got = ape.ape_attention(q, k, v, positions, chunk, scale=0.25)
    want = ape.causal_attention_reference(q, k, v, positions, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature,chunk_scale",
                         [(0.5, 1.0), (0.7, 0.9), (1.0, 0.8), (0.3, 1.2)])
def test_matches_the_definition(temperature, chunk_scale):
    q, k, v, positions, chunk = _case(seed=1)
    got = ape.ape_attention(q, k, v, positions, chunk, 0.25, temperature, chunk_scale)
    want = ape.ape_attention_reference(q, k, v, positions, chunk, 0.25, temperature, chunk_scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, ape.causal_attention_reference(q, k, v, positions, 0.25),
                              atol=1e-3)


def test_rows_that_see_no_chunk_token_are_unchanged():
    q, k, v, _, chunk = _case(seed=2)
    positions = torch.tensor([0, 1, 2, 2, 1])  # before the first chunk token (3)
    got = ape.ape_attention(q, k, v, positions, chunk, 0.25, 0.5, 0.8)
    torch.testing.assert_close(got, ape.causal_attention_reference(q, k, v, positions, 0.25),
                               atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


def test_many_rows_are_blocked_and_dtype_is_kept():
    q, k, v, _, chunk = _case(n=600, keys=700, seed=3)
    chunk = torch.zeros(700, dtype=torch.bool)
    chunk[50:400] = True
    positions = torch.arange(100, 700)
    got = ape.ape_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), positions, chunk, 0.25,
                            0.6, 0.9)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    want = ape.ape_attention(q, k, v, positions, chunk, 0.25, 0.6, 0.9)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
