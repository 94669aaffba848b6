"""Attention-mass oracle: true block mass, top-k by true mass, recall of a selection."""

from __future__ import annotations

import doctest

import pytest
import torch

from vllm_accel.kernels import attention_oracle
from vllm_accel.kernels.attention_oracle import (
    dense_block_mass,
    oracle_select_blocks,
    selection_mass_recall,
)
from vllm_accel.kernels.block_scoring import BlockScoringConfig, select_blocks
from vllm_accel.kernels.block_sparse_attention import (
    BlockSelection,
    QueryBlocks,
    block_sparse_attention,
)

from .conftest import dense_causal_attention, make_paged_batch


def test_doctests():
    assert doctest.testmod(attention_oracle).failed == 0


@pytest.mark.parametrize("ctx", [0, 45])
def test_dense_block_mass_matches_explicit_softmax(ctx):
    g = torch.Generator().manual_seed(0)
    N = 120
    q, k = torch.randn(4, N - ctx, 8, generator=g), torch.randn(2, N, 8, generator=g)
    got = dense_block_mass(q, k, ctx, 32, 16, gqa="mean_mass", chunk_bytes=1 << 12)
    logits = q @ k.repeat_interleave(2, 0).transpose(1, 2) * 8**-0.5
    pos = torch.arange(ctx, N)
    p = torch.softmax(logits.masked_fill(torch.arange(N)[None] > pos[:, None], -torch.inf), -1)
    m0 = ctx // 32
    ref = torch.zeros(4, (N - 1) // 32 - m0 + 1, 8)
    for i, t in enumerate(pos.tolist()):
        for j in range(8):
            ref[:, t // 32 - m0, j] += p[:, i, j * 16 : (j + 1) * 16].sum(-1)
    ref /= torch.bincount(pos // 32 - m0)[None, :, None]
    torch.testing.assert_close(got, ref.view(2, 2, -1, 8).mean(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.ones_like(got.sum(-1)))


def _batch():
    return make_paged_batch([300, 200], [300, 120], num_q_heads=4, num_kv_heads=2,
                            head_dim=16, page_size=32, seed=7)


def test_recall_of_all_blocks_is_one_and_of_oracle_is_at_least_tau():
    batch = _batch()
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, 32)
    full = BlockSelection.all_causal(qb, 32, 2)
    recall = selection_mass_recall(full, batch.query, batch.k_cache, batch.block_table)
    torch.testing.assert_close(recall, torch.ones_like(recall))
    cfg = BlockScoringConfig(query_block_size=32, key_block_size=32, tau=0.7)
    oracle = oracle_select_blocks(batch.query, batch.k_cache, batch.block_table, batch.seq_lens,
                                  batch.query_start_loc, cfg)
    recall = selection_mass_recall(oracle, batch.query, batch.k_cache, batch.block_table)
    assert (recall >= 0.7 - 1e-5).all()
    assert oracle.density() < 1.0


def test_oracle_top_k_dominates_estimator_at_same_budget():
    batch = _batch()
    for method in ("antidiagonal", "mean_pool"):
        cfg = BlockScoringConfig(method=method, query_block_size=32, key_block_size=32,
                                 stride=8, tau=None, density=0.3)
        est = select_blocks(batch.query, batch.k_cache, batch.block_table, batch.seq_lens,
                            batch.query_start_loc, cfg)
        ora = oracle_select_blocks(batch.query, batch.k_cache, batch.block_table,
                                   batch.seq_lens, batch.query_start_loc, cfg)
        assert torch.equal(est.block_counts, ora.block_counts)
        r_est = selection_mass_recall(est, batch.query, batch.k_cache, batch.block_table)
        r_ora = selection_mass_recall(ora, batch.query, batch.k_cache, batch.block_table)
        assert (r_ora >= r_est - 1e-5).all(), method


def test_per_query_head_oracle_and_error_shrinks_with_density():
    batch = _batch()
    dense = dense_causal_attention(batch)
    errors = []
    for density in (0.2, 0.5, 1.0):
        cfg = BlockScoringConfig(query_block_size=32, key_block_size=32, tau=None,
                                 density=density, gqa="per_query_head")
        sel = oracle_select_blocks(batch.query, batch.k_cache, batch.block_table,
                                   batch.seq_lens, batch.query_start_loc, cfg)
        assert sel.num_heads == 4
        out = block_sparse_attention(batch.query, batch.k_cache, batch.v_cache, sel,
                                     batch.block_table, batch.seq_lens, batch.query_start_loc)
        errors.append(float((out - dense).norm() / dense.norm()))
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-5
