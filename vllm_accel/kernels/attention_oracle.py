"""Attention-mass oracle: the true block mass of dense attention, and top-k by true mass.

A diagnostic, not a fast path: it computes the full causal softmax (in row chunks, fp32) to
measure how much attention each (query block, key block) pair really gets,

    mass[h, i, j] = mean over the queries t of query block i of
                    sum over keys s of key block j of softmax_s(scale * q_t . k_s)   (s <= t)

so every row sums to 1. Uses:

* ``oracle_select_blocks``: the best possible selection for a budget (same budgets and forced
  sink/local blocks as ``block_scoring``), the upper bound an estimator can reach;
* ``selection_mass_recall``: the fraction of true attention mass a given selection covers,
  per (query block, head) -- the quality metric of an estimator (1.0 = lossless coverage).

GQA: with one selection per KV head the mass is the mean over the group's query heads
(``gqa='mean_mass'``); ``gqa='per_query_head'`` keeps one row per query head.

Check against a hand-written dense softmax::

    >>> import torch
    >>> from vllm_accel.kernels.attention_oracle import dense_block_mass
    >>> q, k = torch.randn(2, 8, 4), torch.randn(2, 8, 4)
    >>> p = torch.softmax((q @ k.transpose(1, 2) * 0.5).masked_fill(
    ...     torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf")), -1)
    >>> ref = p.view(2, 2, 4, 2, 4).sum(-1).mean(2)  # blocks of 4 x 4
    >>> torch.allclose(dense_block_mass(q, k, 0, 4, 4, gqa="per_query_head"), ref, atol=1e-6)
    True
"""

from __future__ import annotations

import torch

from .block_scoring import BlockScoringConfig, select_blocks_with
from .block_sparse_attention import BlockSelection, QueryBlocks, gather_sequence_kv

__all__ = ["dense_block_mass", "oracle_select_blocks", "selection_mass_recall"]


def dense_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    context_len: int,
    query_block_size: int,
    key_block_size: int,
    *,
    scale: float | None = None,
    gqa: str = "mean_mass",
    chunk_bytes: int = 256 << 20,
) -> torch.Tensor:
    """True block attention mass of one sequence, ``[H_sel, nqb, nkb]`` float32.

    ``q [Hq, q_len, D]`` are the queries at positions ``context_len ..``; ``k [H_kv, seq_len,
    D]`` all keys. Query blocks are aligned to absolute positions as in the attention kernel.
    """
    num_q_heads, q_len, head_dim = q.shape
    num_kv_heads, seq_len, _ = k.shape
    if gqa not in ("mean_mass", "per_query_head"):
        raise ValueError(f"gqa must be 'mean_mass' or 'per_query_head', got {gqa!r}")
    g = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    BQ, BK = query_block_size, key_block_size
    device = q.device
    m0 = context_len // BQ
    nqb = (seq_len - 1) // BQ - m0 + 1
    nkb = -(-seq_len // BK)
    k_f = torch.zeros(num_kv_heads, nkb * BK, head_dim, device=device)
    k_f[:, :seq_len] = k.float()
    k_pos = torch.arange(nkb * BK, device=device)
    q_pos_all = torch.arange(context_len, seq_len, device=device)
    q_block_all = q_pos_all // BQ - m0
    mass = torch.zeros(num_q_heads, nqb, nkb, dtype=torch.float32, device=device)
    rows = max(1, chunk_bytes // max(1, 8 * num_q_heads * nkb * BK))
    for r0 in range(0, q_len, rows):
        r1 = min(q_len, r0 + rows)
        qc = q[:, r0:r1].float().reshape(num_kv_heads, g * (r1 - r0), head_dim)
        s = torch.matmul(qc, k_f.transpose(1, 2)).view(num_q_heads, r1 - r0, nkb * BK) * scale
        future = k_pos[None, :] > q_pos_all[r0:r1, None]  # also hides the padded keys
        p = torch.softmax(s.masked_fill(future, float("-inf")), dim=-1)
        per_row = p.view(num_q_heads, r1 - r0, nkb, BK).sum(-1)  # [Hq, r, nkb]
        mass.index_add_(1, q_block_all[r0:r1], per_row)
    q_count = torch.bincount(q_block_all, minlength=nqb).clamp_min(1)
    mass /= q_count[None, :, None]
    if gqa == "mean_mass" and g > 1:
        mass = mass.view(num_kv_heads, g, nqb, nkb).mean(1)
    return mass


def oracle_select_blocks(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    config: BlockScoringConfig = BlockScoringConfig(),  # noqa: B008 (frozen, immutable)
    *,
    kv_start_loc: torch.Tensor | None = None,
    scale: float | None = None,
    query_blocks: QueryBlocks | None = None,
) -> BlockSelection:
    """Selection by *true* attention mass under ``config``'s budgets (tau / density / top-k,
    sink and local blocks forced). Same inputs as ``block_scoring.select_blocks``;
    ``config.method`` and ``stride`` are ignored; ``config.gqa='per_query_head'`` gives one
    selection per query head, anything else one per KV head (mean mass of the group)."""
    gqa = "per_query_head" if config.gqa == "per_query_head" else "mean_mass"

    def mass_fn(q, k, ctx):
        return dense_block_mass(
            q, k, ctx, config.query_block_size, config.key_block_size, scale=scale, gqa=gqa,
            chunk_bytes=config.chunk_bytes,
        )

    return select_blocks_with(
        mass_fn, query, k_cache, block_table, seq_lens, query_start_loc, config,
        kv_start_loc=kv_start_loc, query_blocks=query_blocks,
    )


def selection_mass_recall(
    selection: BlockSelection,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    *,
    kv_start_loc: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Fraction of the true attention mass inside the selected blocks, ``[NQB, H_sel]``.

    With one selection per KV head the mass is the group mean (``mean_mass``)."""
    qb = selection.query_blocks
    num_q_heads = query.shape[1]
    gqa = "per_query_head" if selection.num_heads == num_q_heads else "mean_mass"
    kv_starts = None if kv_start_loc is None else [int(x) for x in kv_start_loc.tolist()]
    recall = torch.zeros(qb.num_blocks, selection.num_heads, device=query.device)
    q_off = 0
    for b, (n, ql) in enumerate(zip(qb.seq_lens, qb.query_lens)):
        if ql == 0:
            continue
        if block_table is not None:
            k = gather_sequence_kv(k_cache, block_table[b], n)
        else:
            k = k_cache[kv_starts[b] : kv_starts[b] + n].transpose(0, 1)
        q = query[q_off : q_off + ql].transpose(0, 1)
        mass = dense_block_mass(q, k, n - ql, qb.block_size, selection.key_block_size,
                                scale=scale, gqa=gqa)  # [H, nqb_b, nkb]
        rows = selection.rows_of_sequence(b)
        sel = selection.to_mask(mass.shape[-1])[rows].to(mass.device)  # [nqb_b, H, nkb]
        recall[rows] = (mass.transpose(0, 1) * sel).sum(-1)
        q_off += ql
    return recall
