"""Block scoring and selection for block-sparse prefill (the *plan* step).

For each query block of a prefill chunk and each head, estimate how much attention mass each
causal key block will receive, then keep the smallest set of key blocks that covers a cumulative
mass ``tau`` (and/or a top-k budget), always including the attention-sink block(s) at the start
of the sequence and the local window (the diagonal blocks plus ``num_local_blocks`` before them).
The output is a ``BlockSelection`` consumed by ``block_sparse_attention``.

Estimators (both return a per-head ``[H, num_query_blocks, num_key_blocks]`` probability mass,
each row summing to 1 over the causal key blocks):

* ``antidiagonal`` (XAttention-style). Cut the attention matrix into ``S x S`` tiles (``S`` =
  ``stride``) and score each tile by the mean logit along its antidiagonal, i.e. the ``S``
  entries ``q[S*a + S-1-i] . k[S*b + i]``. This is one matrix product between a strided,
  reversed reshaping of Q and a strided reshaping of K (``[N/S, S*D]`` each, so it costs ``1/S``
  of dense attention). Every query row and every key column contributes to exactly one
  antidiagonal entry per tile, so vertical and slash patterns are not missed the way a plain
  subsample would miss them. A softmax over the tile scores (causal at tile granularity) gives
  per-tile attention estimates that are summed into (query block, key block) mass.
* ``mean_pool`` (cheapest). Score block pairs with the mean query of the query block against the
  mean key of the key block, plus ``log(#keys in the block)`` so the softmax over blocks
  approximates the total mass of each block. Cost ``1/(BQ*BK)`` of dense attention.

GQA. ``gqa="pool_query"`` (default) averages the queries of each KV-head group before scoring,
so the estimate and the selection are per KV head and cost as many heads as there are KV heads
(the cheap choice; the attention kernel then loads one block list per group).
``"mean_mass"`` scores each query head and averages the per-head masses of the group (more
faithful, ``Hq / Hkv`` times the cost). ``"per_query_head"`` keeps one selection per query head.

Positions are absolute: query block ``m`` covers positions ``[m*BQ, (m+1)*BQ)`` (see
``block_sparse_attention``), so a chunk of a chunked prefill, or a prefill after a prefix-cache
hit, is scored against all of its sequence's keys, context included. Tiles are aligned the same
way (``BQ`` and ``BK`` must be multiples of ``S``); rows of a tile outside the chunk are zero.

Everything here is vectorized torch (matmuls, softmax, sort, cumsum, gather); the only Python
loops run over sequences and over row chunks that bound the memory of the score matrix.

Plan, then run (a top-k budget of half the causal blocks; sink, local and diagonal blocks are
kept on top of it in the early query blocks)::

    >>> import torch
    >>> from vllm_accel.kernels.block_scoring import BlockScoringConfig, select_blocks_contiguous
    >>> from vllm_accel.kernels.block_sparse_attention import block_sparse_attention_contiguous
    >>> N = 512
    >>> q, k, v = torch.randn(N, 4, 32), torch.randn(N, 2, 32), torch.randn(N, 2, 32)
    >>> loc = torch.tensor([0, N])
    >>> cfg = BlockScoringConfig(query_block_size=64, key_block_size=64, tau=None, density=0.5)
    >>> sel = select_blocks_contiguous(q, k, loc, loc, cfg)
    >>> sel.block_counts[:, 0].tolist(), round(sel.density(), 2)
    ([1, 2, 3, 3, 3, 3, 4, 4], 0.64)
    >>> block_sparse_attention_contiguous(q, k, v, sel, loc, loc).shape
    torch.Size([512, 4, 32])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .block_sparse_attention import BlockSelection, QueryBlocks, gather_sequence_kv

__all__ = [
    "BlockScoringConfig",
    "antidiagonal_block_mass",
    "mean_pooled_block_mass",
    "select_from_block_mass",
    "select_blocks",
    "select_blocks_contiguous",
    "select_blocks_with",
]

_GQA_MODES = ("pool_query", "mean_mass", "per_query_head")


@dataclass(frozen=True)
class BlockScoringConfig:
    """How to score and select key blocks.

    Budgets: a key block is kept if it is forced (sink / local window), or if it ranks among
    the highest-mass blocks while the mass kept so far is below ``tau`` *and* the number kept is
    below the budget ``min(ceil(density * causal_blocks), max_blocks)``. With ``tau``,
    ``density`` and ``max_blocks`` all ``None`` every causal block is kept (dense).
    """

    method: str = "antidiagonal"  # or "mean_pool"
    query_block_size: int = 64
    key_block_size: int = 64
    stride: int = 16  # antidiagonal tile size S
    tau: float | None = 0.9
    density: float | None = None
    max_blocks: int | None = None
    num_sink_blocks: int = 1
    num_local_blocks: int = 1
    gqa: str = "pool_query"
    chunk_bytes: int = 256 << 20  # memory bound for one chunk of the score matrix

    def __post_init__(self):
        if self.method not in ("antidiagonal", "mean_pool"):
            raise ValueError(f"method must be 'antidiagonal' or 'mean_pool', got {self.method!r}")
        if self.gqa not in _GQA_MODES:
            raise ValueError(f"gqa must be one of {_GQA_MODES}, got {self.gqa!r}")
        if self.method == "antidiagonal" and (
            self.query_block_size % self.stride or self.key_block_size % self.stride
        ):
            raise ValueError(
                f"block sizes {self.query_block_size}/{self.key_block_size} must be multiples "
                f"of the antidiagonal stride {self.stride}"
            )
        if self.tau is not None and not 0.0 < self.tau <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {self.tau}")
        if self.density is not None and not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")
        if self.num_sink_blocks < 0 or self.num_local_blocks < 0:
            raise ValueError("num_sink_blocks and num_local_blocks must be >= 0")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_queries(q: torch.Tensor, context_len: int, seq_len: int, block: int):
    """Queries ``[H, q_len, D]`` placed at their absolute positions inside whole query blocks.

    Returns ``(qp [H, nqb*block, D], first_block m0, nqb)``; rows outside the chunk are zero.
    """
    num_heads, q_len, head_dim = q.shape
    m0 = context_len // block
    nqb = (seq_len - 1) // block - m0 + 1
    qp = q.new_zeros(num_heads, nqb * block, head_dim)
    off = context_len - m0 * block
    qp[:, off : off + q_len] = q
    return qp, m0, nqb


def _pad_keys(k: torch.Tensor, block: int) -> torch.Tensor:
    num_heads, n, head_dim = k.shape
    nkb = _cdiv(n, block)
    if nkb * block == n:
        return k
    kp = k.new_zeros(num_heads, nkb * block, head_dim)
    kp[:, :n] = k
    return kp


def _group_queries(
    q: torch.Tensor, num_kv_heads: int, gqa: str, dtype: torch.dtype
) -> torch.Tensor:
    """Queries in ``dtype``: the mean query of each KV-head group for ``gqa='pool_query'``
    (accumulated in fp32, one pass over ``q``), all query heads otherwise."""
    if gqa != "pool_query" or q.shape[0] == num_kv_heads:
        return q.to(dtype)
    g = q.shape[0] // num_kv_heads
    return q.view(num_kv_heads, g, *q.shape[1:]).mean(1, dtype=torch.float32).to(dtype)


def _reduce_group_mass(mass: torch.Tensor, num_kv_heads: int, gqa: str) -> torch.Tensor:
    """Average per-query-head mass over each group for ``gqa='mean_mass'``."""
    if gqa != "mean_mass" or mass.shape[0] == num_kv_heads:
        return mass
    g = mass.shape[0] // num_kv_heads
    return mass.view(num_kv_heads, g, *mass.shape[1:]).mean(1)


def _grouped_matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a [Ha, r, K] @ b_t [Hb, K, c]`` with ``Ha = g * Hb`` (a's heads grouped onto b's)."""
    ha, r, kdim = a.shape
    hb = b_t.shape[0]
    g = ha // hb
    return torch.matmul(a.reshape(hb, g * r, kdim), b_t).view(ha, r, b_t.shape[-1])


def antidiagonal_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    context_len: int,
    config: BlockScoringConfig,
    scale: float | None = None,
) -> torch.Tensor:
    """XAttention-style antidiagonal estimate of the block attention mass of one sequence.

    Args:
        q: ``[Hq, q_len, D]`` queries of the new tokens (positions ``context_len ..``).
        k: ``[H_kv, seq_len, D]`` all keys of the sequence.
    Returns:
        ``[H_sel, nqb, nkb]`` float32, each row summing to 1 over the causal key blocks.
    """
    head_dim = q.shape[-1]
    num_kv_heads, seq_len, _ = k.shape
    S, BQ, BK = config.stride, config.query_block_size, config.key_block_size
    scale = head_dim**-0.5 if scale is None else scale
    # CPUs without native bf16 GEMM are far faster in fp32; GPUs keep the input precision
    dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    q = _group_queries(q, num_kv_heads, config.gqa, dtype)
    num_s = q.shape[0]
    k = k.to(dtype)
    logit_scale = scale / S  # mean logit along the antidiagonal, folded into the queries

    qp, m0, nqb = _pad_queries(q, context_len, seq_len, BQ)
    rows_per_qb = BQ // S
    # strided, reversed queries: row a holds q[S*a + S-1], q[S*a + S-2], ..., q[S*a]
    qs = qp.view(num_s, nqb * rows_per_qb, S, head_dim).flip(2).reshape(num_s, -1, S * head_dim)
    qs = qs * logit_scale
    kp = _pad_keys(k, BK)
    nkb = kp.shape[1] // BK
    cols_per_kb = BK // S
    ks_t = kp.reshape(num_kv_heads, nkb * cols_per_kb, S * head_dim).transpose(1, 2)

    device = q.device
    a_first = m0 * rows_per_qb  # global strided index of the first row
    col = torch.arange(nkb * cols_per_kb, device=device)
    col_ok = col * S < seq_len
    mass = torch.zeros(num_s, nqb, nkb, dtype=torch.float32, device=device)
    bytes_per_qb = 8 * num_s * rows_per_qb * nkb * cols_per_kb  # scores + fp32 softmax
    qb_chunk = max(1, config.chunk_bytes // max(bytes_per_qb, 1))
    for j0 in range(0, nqb, qb_chunk):
        j1 = min(nqb, j0 + qb_chunk)
        a = a_first + torch.arange(j0 * rows_per_qb, j1 * rows_per_qb, device=device)
        a_last = int(a_first + j1 * rows_per_qb - 1)
        ncol = min(nkb, a_last // cols_per_kb + 1) * cols_per_kb  # causal column limit
        s = _grouped_matmul(qs[:, j0 * rows_per_qb : j1 * rows_per_qb], ks_t[:, :, :ncol])
        allowed = (col[None, :ncol] <= a[:, None]) & col_ok[None, :ncol]
        s.masked_fill_(~allowed, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32)
        # sum columns per key block first, then rows (rows outside the chunk weigh 0)
        p = p.view(num_s, j1 - j0, rows_per_qb, ncol // cols_per_kb, cols_per_kb).sum(-1)
        row_ok = ((a * S + S > context_len) & (a * S < seq_len)).view(j1 - j0, rows_per_qb)
        mass[:, j0:j1, : ncol // cols_per_kb] = (p * row_ok[None, :, :, None]).sum(2)
    mass = _reduce_group_mass(mass, num_kv_heads, config.gqa)
    return mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)


def mean_pooled_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    context_len: int,
    config: BlockScoringConfig,
    scale: float | None = None,
) -> torch.Tensor:
    """Block mass from mean-pooled queries and keys (``softmax_j(qbar . kbar_j * scale +
    log n_j)``); same arguments and result as ``antidiagonal_block_mass``."""
    head_dim = q.shape[-1]
    num_kv_heads, seq_len, _ = k.shape
    BQ, BK = config.query_block_size, config.key_block_size
    scale = head_dim**-0.5 if scale is None else scale
    device = q.device
    qp, m0, nqb = _pad_queries(q.float(), context_len, seq_len, BQ)
    pos = (m0 * BQ + torch.arange(nqb * BQ, device=device)).view(nqb, BQ)
    q_count = ((pos >= context_len) & (pos < seq_len)).sum(-1).clamp_min(1)
    q_mean = qp.view(qp.shape[0], nqb, BQ, head_dim).sum(2) / q_count[None, :, None]
    q_mean = _group_queries(q_mean, num_kv_heads, config.gqa, torch.float32)
    kp = _pad_keys(k.float(), BK)
    nkb = kp.shape[1] // BK
    k_count = (seq_len - torch.arange(nkb, device=device) * BK).clamp(1, BK)
    k_mean = kp.view(num_kv_heads, nkb, BK, head_dim).sum(2) / k_count[None, :, None]
    s = _grouped_matmul(q_mean, k_mean.transpose(1, 2)) * scale + torch.log(k_count.float())
    last_kb = (torch.minimum((m0 + torch.arange(nqb, device=device) + 1) * BQ,
                             torch.tensor(seq_len, device=device)) - 1) // BK
    causal = torch.arange(nkb, device=device)[None, :] <= last_kb[:, None]
    mass = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
    return _reduce_group_mass(mass, num_kv_heads, config.gqa)


def _rank_blocks(mass, first_pos, last_pos, key_block_size, tau, density, max_blocks,
                 num_sink_blocks, num_local_blocks):
    """Rank the key blocks of each (head, query block) and say how many to keep.

    Returns ``order [H, nqb, nkb]`` (forced blocks first, then by decreasing mass, non-causal
    last) and ``keep [H, nqb]``: the kept blocks are ``order[..., :keep]``. The kept set is a
    prefix of the ranking because each condition (forced; mass before < tau; rank < budget;
    causal) holds on a prefix.
    """
    num_heads, nqb, nkb = mass.shape
    device = mass.device
    BK = key_block_size
    kb = torch.arange(nkb, device=device)
    last_kb = (last_pos.to(device) // BK)[:, None]
    causal = kb[None, :] <= last_kb  # [nqb, nkb]
    local_from = (first_pos.to(device) // BK)[:, None] - num_local_blocks
    forced = causal & ((kb[None, :] < num_sink_blocks) | (kb[None, :] >= local_from))
    mass = mass.float().masked_fill(~causal, 0.0)
    mass = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
    # priorities: forced 2 > any mass in [0, 1] > non-causal -1
    prio = torch.where(forced, 2.0, torch.where(causal, mass, -1.0))
    prio_sorted, order = prio.sort(dim=-1, descending=True)
    keep = torch.ones_like(prio_sorted, dtype=torch.bool)
    if tau is not None:
        mass_sorted = mass.gather(-1, order)
        keep &= (torch.cumsum(mass_sorted, dim=-1) - mass_sorted) < tau
    budget = None
    if density is not None:
        budget = torch.ceil(density * (last_kb.squeeze(-1) + 1).float())  # [nqb]
    if max_blocks is not None:
        cap = torch.full((nqb,), float(max_blocks), device=device)
        budget = cap if budget is None else torch.minimum(budget, cap)
    if budget is not None:
        keep &= kb[None, None, :].float() < budget[None, :, None]
    keep = (keep | (prio_sorted > 1.5)) & (prio_sorted >= 0.0)
    return order, keep.sum(-1)


def select_from_block_mass(
    mass: torch.Tensor,
    first_pos: torch.Tensor,
    last_pos: torch.Tensor,
    key_block_size: int,
    *,
    tau: float | None,
    density: float | None = None,
    max_blocks: int | None = None,
    num_sink_blocks: int = 1,
    num_local_blocks: int = 1,
) -> torch.Tensor:
    """Turn block mass ``[H, nqb, nkb]`` into a boolean selection ``[nqb, H, nkb]``.

    ``first_pos``/``last_pos`` ``[nqb]`` are the absolute positions of the first and last query
    of each query block. Forced blocks (sinks, and key blocks ``first_pos // BK -
    num_local_blocks ..`` up to the diagonal) are ranked first; the others by decreasing mass.
    Entry ``i`` of that ranking is kept if forced, or if the mass of the entries before it is
    below ``tau`` and ``i`` is below the top-k budget. One sort and one cumsum.
    """
    order, keep = _rank_blocks(mass, first_pos, last_pos, key_block_size, tau, density,
                               max_blocks, num_sink_blocks, num_local_blocks)
    rank = torch.arange(mass.shape[-1], device=mass.device)
    kept_sorted = rank[None, None, :] < keep[..., None]
    selected = torch.zeros_like(kept_sorted).scatter_(-1, order, kept_sorted)
    return selected.transpose(0, 1)


def _select_indices_from_mass(mass, first_pos, last_pos, config):
    """Compact selection ``(indices [nqb, H, max_sel] ascending, -1 padded; counts [nqb, H])``
    straight from the ranking: no ``[nqb, H, nkb]`` mask and compaction pass."""
    nkb = mass.shape[-1]
    order, keep = _rank_blocks(mass, first_pos, last_pos, config.key_block_size, config.tau,
                               config.density, config.max_blocks, config.num_sink_blocks,
                               config.num_local_blocks)
    max_sel = max(int(keep.max()) if keep.numel() else 0, 1)
    top = order[..., :max_sel]
    valid = torch.arange(max_sel, device=mass.device)[None, None, :] < keep[..., None]
    top = torch.where(valid, top, nkb).sort(dim=-1).values  # ascending, pads last
    top = torch.where(top == nkb, -1, top)
    return top.transpose(0, 1).to(torch.int32), keep.transpose(0, 1).to(torch.int32)


MassFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def select_blocks_with(
    mass_fn: MassFn,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    config: BlockScoringConfig,
    *,
    kv_start_loc: torch.Tensor | None = None,
    query_blocks: QueryBlocks | None = None,
) -> BlockSelection:
    """Select blocks of a varlen batch with any per-sequence mass estimator.

    ``mass_fn(q [Hq, q_len, D], k [H_kv, seq_len, D], context_len) -> [H_sel, nqb, nkb]``.
    ``block_table=None`` means contiguous ``k_cache [T_k, H_kv, D]`` with ``kv_start_loc``.
    """
    BQ, BK = config.query_block_size, config.key_block_size
    if query_blocks is None:
        query_blocks = QueryBlocks.build(seq_lens, query_start_loc, BQ, device=query.device)
    elif query_blocks.block_size != BQ:
        raise ValueError("query_blocks.block_size differs from config.query_block_size")
    kv_starts = None if kv_start_loc is None else [int(x) for x in kv_start_loc.tolist()]
    parts = []
    q_off = 0
    for b, (n, ql) in enumerate(zip(query_blocks.seq_lens, query_blocks.query_lens)):
        if ql == 0:
            continue
        rows = slice(query_blocks.seq_block_offsets[b], query_blocks.seq_block_offsets[b + 1])
        k_seq = _sequence_keys(k_cache, b, n, block_table, kv_starts)
        q_seq = query[q_off : q_off + ql].transpose(0, 1)
        mass = mass_fn(q_seq, k_seq, n - ql)
        idx, cnt = _select_indices_from_mass(
            mass, query_blocks.first_pos[rows], query_blocks.last_pos[rows], config)
        parts.append((idx, cnt))
        q_off += ql
    if not parts:
        num_heads = k_cache.shape[-2]
        empty = torch.zeros(0, num_heads, 1, dtype=torch.int32, device=query.device)
        return BlockSelection.from_indices(empty, empty[..., 0], query_blocks, BK)
    max_sel = max(idx.shape[-1] for idx, _ in parts)
    indices = torch.cat([
        torch.nn.functional.pad(idx, (0, max_sel - idx.shape[-1]), value=-1) for idx, _ in parts
    ])
    counts = torch.cat([cnt for _, cnt in parts])
    return BlockSelection.from_indices(indices, counts, query_blocks, BK)


def _sequence_keys(k_cache, b, n, block_table, kv_starts) -> torch.Tensor:
    """Keys of sequence ``b`` as ``[H_kv, n, D]`` from a paged or a contiguous source."""
    if block_table is not None:
        return gather_sequence_kv(k_cache, block_table[b], n)
    s = kv_starts[b]
    return k_cache[s : s + n].transpose(0, 1)


def _mass_fn(config: BlockScoringConfig, scale: float | None) -> MassFn:
    fn = antidiagonal_block_mass if config.method == "antidiagonal" else mean_pooled_block_mass
    return lambda q, k, ctx: fn(q, k, ctx, config, scale)


def select_blocks(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    config: BlockScoringConfig = BlockScoringConfig(),
    *,
    scale: float | None = None,
    query_blocks: QueryBlocks | None = None,
) -> BlockSelection:
    """Score and select key blocks for a prefill chunk over a paged cache (the plan step).

    Args:
        query: ``[T, Hq, D]`` new-token queries; ``k_cache``: ``[num_pages, page_size, H_kv, D]``
            view (context and new keys already written); ``block_table [B, max_pages]``;
            ``seq_lens [B]`` (context + new); ``query_start_loc [B+1]``.
        config: estimator, block sizes and budgets.
        query_blocks: pass a prebuilt ``QueryBlocks`` to reuse it across layers.
    Returns:
        ``BlockSelection`` with ``H_kv`` heads (``Hq`` for ``gqa='per_query_head'``).
    """
    return select_blocks_with(
        _mass_fn(config, scale), query, k_cache, block_table, seq_lens, query_start_loc, config,
        query_blocks=query_blocks,
    )


def select_blocks_contiguous(
    q: torch.Tensor,
    k: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_start_loc: torch.Tensor,
    config: BlockScoringConfig = BlockScoringConfig(),
    *,
    scale: float | None = None,
    query_blocks: QueryBlocks | None = None,
) -> BlockSelection:
    """``select_blocks`` for contiguous varlen keys ``k [T_k, H_kv, D]`` (``kv_start_loc``)."""
    seq_lens = kv_start_loc[1:] - kv_start_loc[:-1]
    return select_blocks_with(
        _mass_fn(config, scale), q, k, None, seq_lens, query_start_loc, config,
        kv_start_loc=kv_start_loc, query_blocks=query_blocks,
    )

