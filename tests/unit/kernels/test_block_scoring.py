"""Block scoring (antidiagonal, mean-pooled) and selection budgets, against naive references."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

from vllm_accel.kernels import block_scoring
from vllm_accel.kernels.block_scoring import (
    BlockScoringConfig,
    antidiagonal_block_mass,
    mean_pooled_block_mass,
    select_blocks,
    select_blocks_contiguous,
    select_from_block_mass,
)
from vllm_accel.kernels.block_sparse_attention import (
    BlockSelection,
    QueryBlocks,
    block_sparse_attention,
)

from .conftest import dense_causal_attention, make_paged_batch


def test_doctests():
    assert doctest.testmod(block_scoring).failed == 0


def _naive_antidiagonal(q, k, ctx, BQ, BK, S, scale):
    """Loop-by-tile reference: softmax over tiles of the mean antidiagonal logit, summed into
    blocks. ``q [H, ql, D]`` and ``k [H, N, D]`` have the same head count (already grouped)."""
    H, ql, D = q.shape
    N = k.shape[1]
    m0, m1 = ctx // BQ, (N - 1) // BQ
    nkb = -(-N // BK)
    rows = range(m0 * BQ // S, (m1 + 1) * BQ // S)
    out = torch.zeros(H, m1 - m0 + 1, nkb, dtype=torch.float64)
    qa = torch.zeros(H, (m1 + 1) * BQ, D, dtype=torch.float64)
    qa[:, ctx:N] = q.double()
    ka = torch.zeros(H, nkb * BK, D, dtype=torch.float64)
    ka[:, :N] = k.double()
    for h in range(H):
        for a in rows:
            if not (a * S + S > ctx and a * S < N):
                continue
            cols = [b for b in range(nkb * BK // S) if b <= a and b * S < N]
            t = torch.tensor([
                sum(float(qa[h, a * S + S - 1 - i] @ ka[h, b * S + i]) for i in range(S)) / S
                for b in cols
            ], dtype=torch.float64) * scale
            p = torch.softmax(t, 0)
            for b, pb in zip(cols, p):
                out[h, a * S // BQ - m0, b * S // BK] += pb
    return (out / out.sum(-1, keepdim=True)).float()


def _naive_mean_pool(q, k, ctx, BQ, BK, scale):
    H, ql, D = q.shape
    N = k.shape[1]
    m0, m1 = ctx // BQ, (N - 1) // BQ
    nkb = -(-N // BK)
    out = torch.zeros(H, m1 - m0 + 1, nkb)
    for i, m in enumerate(range(m0, m1 + 1)):
        lo, hi = max(m * BQ, ctx), min((m + 1) * BQ, N)
        qbar = q[:, lo - ctx : hi - ctx].mean(1)
        last_kb = (hi - 1) // BK
        s = torch.stack([
            (qbar * k[:, j * BK : min(N, (j + 1) * BK)].mean(1)).sum(-1) * scale
            + math.log(min(N, (j + 1) * BK) - j * BK)
            for j in range(last_kb + 1)
        ], -1)
        out[:, i, : last_kb + 1] = torch.softmax(s, -1)
    return out


@pytest.mark.parametrize("ctx,N", [(0, 128), (37, 128), (100, 131)])
def test_antidiagonal_mass_matches_tile_loop(ctx, N):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, N - ctx, 8, generator=g)
    k = torch.randn(2, N, 8, generator=g)
    cfg = BlockScoringConfig(query_block_size=32, key_block_size=16, stride=4,
                             chunk_bytes=1 << 12)  # several row chunks
    got = antidiagonal_block_mass(q, k, ctx, cfg, scale=0.3)
    ref = _naive_antidiagonal(q, k, ctx, 32, 16, 4, 0.3)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_antidiagonal_gqa_modes():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(4, 64, 8, generator=g), torch.randn(2, 64, 8, generator=g)
    base = dict(query_block_size=16, key_block_size=16, stride=4)
    pooled = antidiagonal_block_mass(q, k, 0, BlockScoringConfig(gqa="pool_query", **base))
    ref = _naive_antidiagonal(q.view(2, 2, 64, 8).mean(1), k, 0, 16, 16, 4, 8**-0.5)
    torch.testing.assert_close(pooled, ref, atol=1e-5, rtol=1e-4)
    per_head = antidiagonal_block_mass(q, k, 0, BlockScoringConfig(gqa="per_query_head", **base))
    ref_h = _naive_antidiagonal(q, k.repeat_interleave(2, 0), 0, 16, 16, 4, 8**-0.5)
    torch.testing.assert_close(per_head, ref_h, atol=1e-5, rtol=1e-4)
    mean_mass = antidiagonal_block_mass(q, k, 0, BlockScoringConfig(gqa="mean_mass", **base))
    torch.testing.assert_close(mean_mass, ref_h.view(2, 2, 4, 4).mean(1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("ctx,N", [(0, 96), (50, 100)])
def test_mean_pooled_mass_matches_loop(ctx, N):
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, N - ctx, 8, generator=g), torch.randn(2, N, 8, generator=g)
    cfg = BlockScoringConfig(method="mean_pool", query_block_size=32, key_block_size=16)
    got = mean_pooled_block_mass(q, k, ctx, cfg, scale=0.5)
    torch.testing.assert_close(got, _naive_mean_pool(q, k, ctx, 32, 16, 0.5), atol=1e-5,
                               rtol=1e-4)


def _policy(mass, first, last, **kw):
    kw.setdefault("tau", None)
    return select_from_block_mass(mass, torch.tensor(first), torch.tensor(last), 16, **kw)


def test_selection_keeps_sink_and_local_window_always():
    mass = torch.zeros(1, 1, 10)
    mass[0, 0, 4] = 1.0  # all mass on block 4
    # query block covering positions 128..143 -> diagonal key block 8
    sel = _policy(mass, [128], [143], tau=0.5, num_sink_blocks=2, num_local_blocks=1)
    assert torch.nonzero(sel[0, 0]).flatten().tolist() == [0, 1, 4, 7, 8]
    sel = _policy(mass, [128], [143], tau=0.5, num_sink_blocks=0, num_local_blocks=0)
    assert torch.nonzero(sel[0, 0]).flatten().tolist() == [4, 8]


def test_selection_tau_is_cumulative_mass():
    mass = torch.tensor([[[0.05, 0.4, 0.3, 0.15, 0.05, 0.05, 0.0, 0.0]]])
    kw = dict(num_sink_blocks=1, num_local_blocks=0)
    # forced: sink 0 and diagonal 5 (mass 0.10); then 0.4 -> 0.5, 0.3 -> 0.8, 0.15 -> 0.95
    keep = lambda tau: torch.nonzero(_policy(mass, [80], [95], tau=tau, **kw)[0, 0]).flatten()
    assert keep(0.5).tolist() == [0, 1, 5]
    assert keep(0.75).tolist() == [0, 1, 2, 5]
    assert keep(0.9).tolist() == [0, 1, 2, 3, 5]
    assert keep(1.0).tolist() == [0, 1, 2, 3, 4, 5]
    assert _policy(mass, [80], [95], **kw)[0, 0].sum() == 6  # no budget: all causal blocks


def test_selection_budgets_density_and_max_blocks():
    g = torch.Generator().manual_seed(3)
    mass = torch.rand(2, 3, 40, generator=g)
    first, last = [160, 320, 600], [175, 335, 639]  # causal blocks 11, 21, 40
    sel = _policy(mass, first, last, density=0.25, num_sink_blocks=1, num_local_blocks=1)
    counts = sel.sum(-1)
    assert counts[:, 0].tolist() == [max(3, math.ceil(0.25 * n)) for n in (11, 21, 40)]
    sel = _policy(mass, first, last, max_blocks=5, num_sink_blocks=1, num_local_blocks=1)
    assert (sel.sum(-1) == 5).all()
    # the free choices are the highest-mass non-forced blocks
    row = sel[2, 1].clone()
    forced = [0, 36, 37, 38, 39]
    assert row[forced].all() and row.sum() == 5
    sel = _policy(mass, first, last, max_blocks=7, num_sink_blocks=1, num_local_blocks=1)
    free = mass[1, 2].clone()
    free[forced] = -1
    assert set(torch.nonzero(sel[2, 1]).flatten().tolist()) == set(forced) | set(
        free.topk(2).indices.tolist())


def test_needle_block_is_found_by_both_estimators():
    g = torch.Generator().manual_seed(4)
    N, D = 512, 32
    u = torch.randn(D, generator=g)
    u = 4.0 * u / u.norm()  # a direction shared by all queries ...
    q = torch.randn(N, 4, D, generator=g) + u
    k = torch.randn(N, 2, D, generator=g)
    k[5 * 32 : 6 * 32] += u  # ... that only the keys of block 5 match
    loc = torch.tensor([0, N])
    for method in ("antidiagonal", "mean_pool"):
        cfg = BlockScoringConfig(method=method, query_block_size=64, key_block_size=32, stride=8,
                                 tau=None, max_blocks=5)  # 4 forced + 1 free
        sel = select_blocks_contiguous(q, k, loc, loc, cfg)
        last = sel.block_indices[-1]  # last query block, both KV heads
        assert all(5 in last[h, : sel.block_counts[-1, h]].tolist() for h in range(2)), method


def test_paged_and_contiguous_selection_agree_with_context():
    batch = make_paged_batch([200, 130], [90, 130], page_size=16)
    cfg = BlockScoringConfig(query_block_size=32, key_block_size=32, stride=8, tau=0.6)
    paged = select_blocks(batch.query, batch.k_cache, batch.block_table, batch.seq_lens,
                          batch.query_start_loc, cfg)
    flat = select_blocks_contiguous(batch.query, batch.k_flat, batch.query_start_loc,
                                    batch.kv_start_loc, cfg)
    assert torch.equal(paged.block_indices, flat.block_indices)
    assert torch.equal(paged.num_offband, flat.num_offband)
    assert paged.num_heads == 2
    assert paged.query_blocks.index.tolist() == [3, 4, 5, 6, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("method", ["antidiagonal", "mean_pool"])
def test_tau_one_reproduces_dense_attention(method):
    batch = make_paged_batch([150, 80], [70, 80], page_size=32)
    cfg = BlockScoringConfig(method=method, query_block_size=32, key_block_size=16, stride=8,
                             tau=1.0, gqa="per_query_head")
    sel = select_blocks(batch.query, batch.k_cache, batch.block_table, batch.seq_lens,
                        batch.query_start_loc, cfg)
    assert sel.num_heads == 4 and sel.density() == pytest.approx(1.0)
    out = block_sparse_attention(batch.query, batch.k_cache, batch.v_cache, sel,
                                 batch.block_table, batch.seq_lens, batch.query_start_loc)
    torch.testing.assert_close(out, dense_causal_attention(batch), atol=2e-5, rtol=1e-5)


def test_density_budget_is_met_and_selection_is_consistent():
    batch = make_paged_batch([1024], [1024], num_q_heads=4, num_kv_heads=1, head_dim=16,
                             page_size=128)
    cfg = BlockScoringConfig(query_block_size=64, key_block_size=32, stride=16, tau=None,
                             density=0.2)
    sel = select_blocks(batch.query, batch.k_cache, batch.block_table, batch.seq_lens,
                        batch.query_start_loc, cfg)
    assert isinstance(sel, BlockSelection)
    causal = sel.query_blocks.num_causal_key_blocks(32)
    # budget ceil(0.2 * causal), but never fewer than the forced sink + local + diagonal blocks
    expected = torch.maximum(torch.ceil(0.2 * causal), torch.minimum(causal, torch.tensor(4)))
    assert sel.block_counts[:, 0].tolist() == expected.int().tolist()
    # lists are ascending and causal
    for r in range(sel.query_blocks.num_blocks):
        idx = sel.block_indices[r, 0, : sel.block_counts[r, 0]]
        assert torch.all(idx[1:] > idx[:-1]) and int(idx[-1]) < int(causal[r])


def test_config_validation():
    with pytest.raises(ValueError):
        BlockScoringConfig(query_block_size=64, stride=24)
    with pytest.raises(ValueError):
        BlockScoringConfig(tau=0.0)
    with pytest.raises(ValueError):
        BlockScoringConfig(gqa="sum")
    assert QueryBlocks.build(torch.tensor([5]), torch.tensor([0, 0]), 16).num_blocks == 0


def test_compact_selection_equals_mask_selection():
    from vllm_accel.kernels.block_scoring import _select_indices_from_mass

    g = torch.Generator().manual_seed(8)
    mass = torch.rand(3, 5, 12, generator=g)
    first = torch.tensor([0, 40, 64, 100, 170])
    last = torch.tensor([31, 63, 95, 127, 181])
    for kw in (dict(tau=0.5), dict(tau=None, density=0.3), dict(tau=0.8, max_blocks=4)):
        cfg = BlockScoringConfig(key_block_size=16, query_block_size=32, stride=16, **kw)
        idx, cnt = _select_indices_from_mass(mass, first, last, cfg)
        mask = select_from_block_mass(mass, first, last, 16, **kw)
        qb = QueryBlocks(32, torch.zeros(5, dtype=torch.int32), torch.arange(5, dtype=torch.int32),
                         first, last, (182,), (182,), (0, 5))
        ref = BlockSelection.from_mask(mask, qb, 16)
        assert torch.equal(cnt, ref.block_counts)
        assert torch.equal(idx[..., : ref.block_indices.shape[-1]], ref.block_indices)
