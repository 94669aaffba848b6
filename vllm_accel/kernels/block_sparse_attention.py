"""Block-sparse causal attention for long prefills, over a paged KV cache.

What it computes
----------------
For every sequence of a varlen prefill batch, the new tokens' queries attend causally to the
sequence's keys (prior context already in the cache *and* the new tokens), but only inside the
key blocks that a selection step picked for their query block::

    out[t, h] = softmax_j( scale * q[t, h] . k[j, h // G] )  over  j <= pos(t),  block(j) selected

The work is split the FlashInfer way: a *plan* (``block_scoring.select_blocks`` or
``BlockSelection.from_mask``) builds a per-(query block, head) list of key blocks, and *run*
(``block_sparse_attention``) consumes it; with every causal block selected the result equals
dense causal attention.

Block geometry
--------------
Query blocks are aligned to **absolute positions**: query block ``m`` of a sequence holds the new
tokens at positions ``[m*BQ, (m+1)*BQ)``; key block ``j`` holds keys ``[j*BK, (j+1)*BK)``.
A sequence with ``seq_len`` tokens of which ``q_len`` are new (vLLM's chunked prefill and
prefix-cache hits: ``context = seq_len - q_len``) has query blocks ``context // BQ ..
(seq_len - 1) // BQ``; the first and last may be partial. Because the grids are aligned, the
causal boundary of a query block only crosses key blocks ``>= first_pos // BK``; selected blocks
below that are processed without any mask ("off-band"), the rest with the causal mask.

Selection format (``BlockSelection``, CSR-like with padding):

* ``block_indices  int32 [NQB, H_sel, max_sel]``  key-block indices, ascending, padded with -1
* ``block_counts   int32 [NQB, H_sel]``           number of valid entries
* ``num_offband    int32 [NQB, H_sel]``           leading entries strictly left of the diagonal

``H_sel`` is the number of KV heads (one selection per GQA group; the default of the scoring step)
or the number of query heads (one selection per query head). Query head ``h`` uses selection row
``h // (Hq // H_sel)`` and KV head ``h // (Hq // Hkv)``.

KV-cache layout
---------------
All functions take the cache as a pair of views ``k_cache, v_cache`` with the logical shape
``[num_pages, page_size, H_kv, D]`` and any strides, plus ``block_table [B, max_pages]``
(page ids). vLLM's layouts map onto such views without a copy:

* CPU (``CPU_ATTN``): per layer ``[num_pages, H_kv, page_size, 2*D]`` where each (page,
  head) holds a K tile then a V tile, each packed the way vLLM's CPU attention ISA wants it
  (``vec``: K transposed) -> ``kv_cache_views_cpu(kv_cache, isa)`` (strided views; for the
  ``amx`` packing, objects that unpack the pages they gather -- torch path only);
* CUDA FlashAttention / Triton: the same logical shape with K|V concatenated in the last dim
  -> ``kv_cache_views_split_last_dim``.

The key block size need not equal the page size: keys are gathered through the block table
(a page may hold several key blocks, or a key block may span several pages).

Implementations
---------------
* ``triton``: a flash-attention style kernel (online softmax, ``exp2`` with ``log2(e)`` folded into
  the scale, causal mask only on the diagonal blocks), one program per (query block, query head),
  reading pages directly. Programs of one query block are adjacent (heads of a GQA group share
  K/V through L2) and the longest query blocks are launched first.
* ``torch``: the CPU path, built from batched gathers and SDPA (never a loop over key blocks).
  Per sequence, runs of consecutive query blocks gather their selected key blocks (all heads at
  once, one ``index_select`` of whole blocks) followed by their diagonal region, and call the
  CPU flash-attention kernel once per run with a mask that is causal on the diagonal region
  only and shared by all blocks and heads; ragged runs (heads with different counts) attend
  diagonal and off-band parts separately and merge them by log-sum-exp. Use query blocks of
  256 rows (a multiple of the key block) on the CPU.
* ``block_sparse_attention_reference``: plain dense masked attention in fp32 (the oracle).

Example (dense reference check; all blocks selected equals causal attention)::

    >>> import torch, torch.nn.functional as F
    >>> from vllm_accel.kernels.block_sparse_attention import (
    ...     BlockSelection, QueryBlocks, block_sparse_attention_contiguous)
    >>> N, Hq, Hkv, D = 96, 4, 2, 16
    >>> q, k, v = torch.randn(N, Hq, D), torch.randn(N, Hkv, D), torch.randn(N, Hkv, D)
    >>> loc = torch.tensor([0, N])
    >>> qb = QueryBlocks.build(seq_lens=torch.tensor([N]), query_start_loc=loc, block_size=32)
    >>> sel = BlockSelection.all_causal(qb, key_block_size=32, num_heads=Hkv)
    >>> o = block_sparse_attention_contiguous(q, k, v, sel, query_start_loc=loc, kv_start_loc=loc)
    >>> ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
    ...     v.transpose(0, 1), is_causal=True, enable_gqa=True).transpose(0, 1)
    >>> torch.allclose(o, ref, atol=1e-5)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._triton_utils import HAS_TRITON, choose_backend, next_power_of_2, tl, triton

__all__ = [
    "QueryBlocks",
    "BlockSelection",
    "PackedKVPages",
    "kv_cache_views_cpu",
    "kv_cache_views_split_last_dim",
    "gather_sequence_kv",
    "block_sparse_attention",
    "block_sparse_attention_contiguous",
    "block_sparse_attention_reference",
]


# --------------------------------------------------------------------------------------------
# Layout: KV-cache views, query blocks, selections
# --------------------------------------------------------------------------------------------


class PackedKVPages:
    """K or V pages in a layout that no strided view expresses (vLLM's AMX tile packing).

    Duck-types the part of a ``[num_pages, page_size, H_kv, D]`` tensor the torch paths use:
    ``shape``, ``dtype``, ``device`` and ``index_select(0, pages)``, which returns the selected
    pages unpacked as a plain tensor. The Triton kernel does not take these (CUDA caches are
    strided views).
    """

    def __init__(self, raw: torch.Tensor, page_size: int, head_dim: int, unpack):
        self.raw = raw  # [num_pages, H_kv, page_size * head_dim], one packed tile per page/head
        self.unpack = unpack  # [n, H, page*D] packed -> [n, H, page, D] plain
        self.shape = torch.Size((raw.shape[0], page_size, raw.shape[1], head_dim))
        self.dtype, self.device = raw.dtype, raw.device

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise ValueError("PackedKVPages supports index_select over pages (dim 0) only")
        return self.unpack(self.raw.index_select(0, index)).transpose(1, 2)


def _unpack_amx_keys(packed: torch.Tensor, page_size: int, head_dim: int) -> torch.Tensor:
    # token t = 16*g + o, dim d = 2*j + r stored at g*16*D + j*32 + o*2 + r (pairs of dims of
    # 16 tokens form one 64-byte AMX tile row)
    n, h = packed.shape[:2]
    x = packed.view(n, h, page_size // 16, head_dim // 2, 16, 2)
    return x.permute(0, 1, 2, 4, 3, 5).reshape(n, h, page_size, head_dim)


def _unpack_amx_values(packed: torch.Tensor, page_size: int, head_dim: int) -> torch.Tensor:
    # dim d = 16*i + j, token t = 2*u + r stored at i*16*P + u*32 + j*2 + r (pairs of tokens)
    n, h = packed.shape[:2]
    x = packed.view(n, h, head_dim // 16, page_size // 2, 16, 2)
    return x.permute(0, 1, 3, 5, 2, 4).reshape(n, h, page_size, head_dim)


def kv_cache_views_cpu(kv_cache: torch.Tensor, isa: str = "vec"):
    """K and V ``[num_pages, page_size, H_kv, D]`` views of a vLLM CPU_ATTN layer cache.

    The CPU cache is ``[num_pages, H_kv, page_size, 2*D]``, in memory ``[num_pages, H_kv,
    2*page_size, D]``: per (page, head) a K tile of ``page_size * D`` elements, then a V tile.
    What is inside a tile depends on the attention ISA vLLM picked (``layer.isa``), because
    ``cpu_attn_reshape_and_cache`` writes each ISA's own packing:

    * ``"vec"``, ``"vec16"`` (x86 without AMX): K tile stored transposed (``[D, page]``),
      V tile row-major (``[page, D]``) -> two strided views, no copy (checked against vLLM
      0.32's writer in the tests);
    * ``"amx"`` (bf16 with AMX): K and V in AMX tile order -> ``PackedKVPages`` objects that
      unpack the pages they gather (layout from vLLM's ``cpu_attn_amx.hpp``; not checked on
      AMX hardware);
    * ``"plain"``: K and V tiles both row-major (a layout of our own, e.g. for tests).

    Other ISAs (neon, vsx, vxe, rvv) raise ``NotImplementedError``.
    """
    num_pages, num_heads, page_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    pages = kv_cache.view(num_pages, num_heads, 2 * page_size, head_dim)
    k_tiles, v_tiles = pages[:, :, :page_size], pages[:, :, page_size:]
    if isa == "plain":
        return k_tiles.transpose(1, 2), v_tiles.transpose(1, 2)
    if isa in ("vec", "vec16"):
        sp, sh = pages.stride(0), pages.stride(1)
        k = k_tiles.as_strided(
            (num_pages, page_size, num_heads, head_dim), (sp, 1, sh, page_size),
            storage_offset=k_tiles.storage_offset(),
        )
        return k, v_tiles.transpose(1, 2)
    if isa == "amx":
        if page_size % 32 or head_dim % 32:
            raise ValueError("AMX packing needs page_size and head_dim multiples of 32")
        raw = kv_cache.view(num_pages, num_heads, 2, page_size * head_dim)
        return (
            PackedKVPages(raw[:, :, 0], page_size, head_dim,
                          lambda x: _unpack_amx_keys(x, page_size, head_dim)),
            PackedKVPages(raw[:, :, 1], page_size, head_dim,
                          lambda x: _unpack_amx_values(x, page_size, head_dim)),
        )
    raise NotImplementedError(f"vLLM CPU attention ISA {isa!r}: KV page layout not supported")


def kv_cache_views_split_last_dim(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views of a CUDA FlashAttention/Triton layer cache (K|V in the last dim).

    ``kv_cache`` is the logical ``[num_pages, H_kv, page_size, 2*D]`` view vLLM hands the
    backend (any physical stride order); this mirrors ``kv_cache.transpose(1, 2).split(D, -1)``
    in vLLM's own Triton/FlashAttention backends.
    """
    head_size = kv_cache.shape[-1] // 2
    k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return k, v


@dataclass(frozen=True)
class QueryBlocks:
    """The query blocks of a varlen batch, aligned to absolute positions (see module doc).

    Tensors are on the device the kernels run on; per-sequence lengths are kept on the host too,
    since the torch paths loop over sequences.
    """

    block_size: int
    seq: torch.Tensor  # int32 [NQB] sequence of each query block
    index: torch.Tensor  # int32 [NQB] absolute block index m (rows m*BQ .. (m+1)*BQ-1)
    first_pos: torch.Tensor  # int64 [NQB] first absolute position with a query in the block
    last_pos: torch.Tensor  # int64 [NQB] last absolute position with a query in the block
    seq_lens: tuple[int, ...]  # host, per sequence
    query_lens: tuple[int, ...]  # host, per sequence
    seq_block_offsets: tuple[int, ...]  # host [B+1]: query blocks of seq b are rows [o[b], o[b+1])

    @classmethod
    def build(
        cls,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
        device: torch.device | str | None = None,
    ) -> QueryBlocks:
        """Enumerate query blocks from vLLM metadata (``seq_lens [B]`` = context + new tokens,
        ``query_start_loc [B+1]``). Pass host tensors when you have them (no device sync)."""
        if device is None:
            device = seq_lens.device
        seq_lens_l = [int(x) for x in seq_lens.tolist()]
        qsl = [int(x) for x in query_start_loc.tolist()]
        query_lens = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens_l))]
        seq, index, first, last, offsets = [], [], [], [], [0]
        for b, (n, ql) in enumerate(zip(seq_lens_l, query_lens)):
            ctx = n - ql
            if ql < 0 or ctx < 0:
                raise ValueError(f"sequence {b}: query_len {ql} > seq_len {n}")
            if ql > 0:
                m0, m1 = ctx // block_size, (n - 1) // block_size
                for m in range(m0, m1 + 1):
                    seq.append(b)
                    index.append(m)
                    first.append(max(m * block_size, ctx))
                    last.append(min((m + 1) * block_size, n) - 1)
            offsets.append(len(seq))
        return cls(
            block_size=int(block_size),
            seq=torch.tensor(seq, dtype=torch.int32, device=device),
            index=torch.tensor(index, dtype=torch.int32, device=device),
            first_pos=torch.tensor(first, dtype=torch.int64, device=device),
            last_pos=torch.tensor(last, dtype=torch.int64, device=device),
            seq_lens=tuple(seq_lens_l),
            query_lens=tuple(query_lens),
            seq_block_offsets=tuple(offsets),
        )

    @property
    def num_blocks(self) -> int:
        return int(self.seq.numel())

    @property
    def device(self) -> torch.device:
        return self.seq.device

    def num_causal_key_blocks(self, key_block_size: int) -> torch.Tensor:
        """Key blocks each query block may see: ``last_pos // BK + 1`` (int64 [NQB])."""
        return self.last_pos // key_block_size + 1

    def first_diagonal_key_block(self, key_block_size: int) -> torch.Tensor:
        """First key block crossed by the causal boundary: ``first_pos // BK`` (int64 [NQB])."""
        return self.first_pos // key_block_size


@dataclass
class BlockSelection:
    """Per-(query block, head) lists of selected key blocks (see module doc for the format)."""

    query_blocks: QueryBlocks
    key_block_size: int
    block_indices: torch.Tensor  # int32 [NQB, H_sel, max_sel], ascending, -1 padded
    block_counts: torch.Tensor  # int32 [NQB, H_sel]
    num_offband: torch.Tensor  # int32 [NQB, H_sel]

    @property
    def num_heads(self) -> int:
        return int(self.block_counts.shape[1])

    @property
    def query_block_size(self) -> int:
        return self.query_blocks.block_size

    @classmethod
    def from_mask(
        cls, mask: torch.Tensor, query_blocks: QueryBlocks, key_block_size: int
    ) -> BlockSelection:
        """Build a selection from a boolean block mask ``[NQB, H_sel, num_key_blocks]``.

        Non-causal entries (key block beyond the query block's last position) are dropped.
        Vectorized compaction: each selected block is scattered to its rank among the selected.
        """
        nqb, num_heads, nkb = mask.shape
        if nqb != query_blocks.num_blocks:
            raise ValueError(f"mask has {nqb} query blocks, expected {query_blocks.num_blocks}")
        device = mask.device
        kb = torch.arange(nkb, device=device)
        causal_limit = query_blocks.num_causal_key_blocks(key_block_size).to(device)
        mask = mask & (kb[None, None, :] < causal_limit[:, None, None])
        counts = mask.sum(-1)
        max_sel = max(int(counts.max()) if counts.numel() else 0, 1)
        rank = torch.cumsum(mask, dim=-1) - 1
        # unselected entries go to a scratch column that is cut off afterwards
        target = torch.where(mask, rank, torch.full_like(rank, max_sel))
        indices = torch.full((nqb, num_heads, max_sel + 1), -1, dtype=torch.int32, device=device)
        indices.scatter_(-1, target, kb.to(torch.int32).expand(nqb, num_heads, nkb).contiguous())
        indices = indices[..., :max_sel].contiguous()
        diag = query_blocks.first_diagonal_key_block(key_block_size).to(device)
        offband = (mask & (kb[None, None, :] < diag[:, None, None])).sum(-1)
        return cls(
            query_blocks=query_blocks,
            key_block_size=int(key_block_size),
            block_indices=indices,
            block_counts=counts.to(torch.int32),
            num_offband=offband.to(torch.int32),
        )

    @classmethod
    def from_indices(
        cls,
        block_indices: torch.Tensor,
        block_counts: torch.Tensor,
        query_blocks: QueryBlocks,
        key_block_size: int,
    ) -> BlockSelection:
        """Wrap compact lists (``[NQB, H, max_sel]`` ascending and causal, -1 padded, with
        ``[NQB, H]`` counts) and derive ``num_offband``."""
        diag = query_blocks.first_diagonal_key_block(key_block_size).to(block_indices.device)
        slot = torch.arange(block_indices.shape[-1], device=block_indices.device)
        offband = ((slot[None, None, :] < block_counts[..., None])
                   & (block_indices < diag[:, None, None])).sum(-1)
        return cls(
            query_blocks=query_blocks,
            key_block_size=int(key_block_size),
            block_indices=block_indices.to(torch.int32).contiguous(),
            block_counts=block_counts.to(torch.int32).contiguous(),
            num_offband=offband.to(torch.int32),
        )

    @classmethod
    def all_causal(
        cls, query_blocks: QueryBlocks, key_block_size: int, num_heads: int
    ) -> BlockSelection:
        """Every causal key block selected: block-sparse attention becomes dense attention."""
        nkb = max(
            (n + key_block_size - 1) // key_block_size for n in query_blocks.seq_lens or (1,)
        )
        mask = torch.ones(
            query_blocks.num_blocks, num_heads, max(nkb, 1), dtype=torch.bool,
            device=query_blocks.device,
        )
        return cls.from_mask(mask, query_blocks, key_block_size)

    def to_mask(self, num_key_blocks: int | None = None) -> torch.Tensor:
        """Boolean block mask ``[NQB, H_sel, num_key_blocks]`` (longer lists are cut off)."""
        if num_key_blocks is None:
            num_key_blocks = max(
                (n + self.key_block_size - 1) // self.key_block_size
                for n in self.query_blocks.seq_lens or (1,)
            )
        nqb, num_heads, max_sel = self.block_indices.shape
        mask = torch.zeros(nqb, num_heads, num_key_blocks + 1, dtype=torch.bool,
                           device=self.block_indices.device)
        valid = torch.arange(max_sel, device=mask.device)[None, None, :] < self.block_counts[
            ..., None
        ]
        valid &= self.block_indices < num_key_blocks  # entries beyond are cut off
        idx = torch.where(valid, self.block_indices.long(), num_key_blocks)
        mask.scatter_(-1, idx, True)
        return mask[..., :num_key_blocks]

    def density(self) -> float:
        """Selected key blocks / causal key blocks, over all query blocks and heads."""
        causal = self.query_blocks.num_causal_key_blocks(self.key_block_size)
        total = float(causal.sum()) * self.num_heads
        return float(self.block_counts.sum()) / total if total else 0.0

    def rows_of_sequence(self, b: int) -> slice:
        o = self.query_blocks.seq_block_offsets
        return slice(o[b], o[b + 1])


def gather_sequence_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """All ``seq_len`` keys (or values) of one sequence as a contiguous ``[H_kv, seq_len, D]``.

    ``cache`` is a ``[num_pages, page_size, H_kv, D]`` view (any strides).
    """
    return _gather_pages(cache, block_table_row, seq_len)[:, :seq_len]


def _gather_pages(cache, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The pages holding ``seq_len`` tokens, as a contiguous ``[H_kv, pages * page_size, D]``."""
    page_size = cache.shape[1]
    num_pages = (seq_len + page_size - 1) // page_size
    pages = cache.index_select(0, block_table_row[:num_pages].to(cache.device).long())
    # [P, page, H, D] -> [H, P*page, D]
    return pages.permute(2, 0, 1, 3).reshape(cache.shape[2], num_pages * page_size, cache.shape[3])


def _sequence_kv(
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    b: int,
    seq_len: int,
    block_table: torch.Tensor | None,
    kv_starts: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of sequence ``b`` as ``[H_kv, seq_len, D]``, paged or contiguous source."""
    if block_table is not None:
        return (
            gather_sequence_kv(k_src, block_table[b], seq_len),
            gather_sequence_kv(v_src, block_table[b], seq_len),
        )
    s = kv_starts[b]
    return k_src[s : s + seq_len].transpose(0, 1), v_src[s : s + seq_len].transpose(0, 1)


def _check_heads(num_q_heads: int, num_kv_heads: int, num_sel_heads: int) -> tuple[int, int]:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads not a multiple of {num_kv_heads} KV heads")
    if num_sel_heads not in (num_kv_heads, num_q_heads):
        raise ValueError(
            f"selection has {num_sel_heads} heads; expected {num_kv_heads} (per KV head) "
            f"or {num_q_heads} (per query head)"
        )
    return num_q_heads // num_kv_heads, num_q_heads // num_sel_heads


# --------------------------------------------------------------------------------------------
# Reference: dense attention under the explicit token mask
# --------------------------------------------------------------------------------------------


def block_sparse_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    selection: BlockSelection,
    block_table: torch.Tensor | None,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    kv_start_loc: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Dense fp32 attention restricted to the selected blocks (the oracle for the kernels).

    ``block_table=None`` means contiguous ``k_cache/v_cache [T_k, H_kv, D]`` with
    ``kv_start_loc [B+1]``. Rows that see no key (impossible when the diagonal block is selected)
    give zeros.
    """
    _, num_q_heads, head_dim = query.shape
    scale = head_dim**-0.5 if scale is None else scale
    qb = selection.query_blocks
    BQ, BK = qb.block_size, selection.key_block_size
    num_kv_heads = k_cache.shape[-2]
    kv_group, sel_group = _check_heads(num_q_heads, num_kv_heads, selection.num_heads)
    kv_starts = None if kv_start_loc is None else [int(x) for x in kv_start_loc.tolist()]
    qsl = [int(x) for x in query_start_loc.tolist()]
    out = torch.zeros_like(query)
    for b, n in enumerate(int(x) for x in seq_lens.tolist()):
        ql = qsl[b + 1] - qsl[b]
        if ql == 0:
            continue
        ctx = n - ql
        k, v = _sequence_kv(k_cache, v_cache, b, n, block_table, kv_starts)
        k = k.float().repeat_interleave(kv_group, 0)
        v = v.float().repeat_interleave(kv_group, 0)
        q = query[qsl[b] : qsl[b + 1]].float().transpose(0, 1)  # [Hq, ql, D]
        rows = selection.rows_of_sequence(b)
        nkb = (n + BK - 1) // BK
        block_mask = selection.to_mask(nkb)[rows]  # [nqb_b, H_sel, nkb]
        block_mask = block_mask.repeat_interleave(sel_group, 1)  # [nqb_b, Hq, nkb]
        q_pos = torch.arange(ctx, n, device=query.device)
        k_pos = torch.arange(n, device=query.device)
        qblk = q_pos // BQ - (ctx // BQ)  # row of each query within this sequence's blocks
        token_mask = block_mask[qblk][:, :, k_pos // BK].transpose(0, 1)  # [Hq, ql, n]
        token_mask &= k_pos[None, None, :] <= q_pos[None, :, None]
        s = torch.einsum("hqd,hkd->hqk", q, k) * scale
        s = s.masked_fill(~token_mask, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[qsl[b] : qsl[b + 1]] = torch.einsum("hqk,hkd->hqd", p, v).transpose(0, 1).to(out.dtype)
    return out


# --------------------------------------------------------------------------------------------
# Torch path (CPU): batched block gathers + the CPU flash-attention kernel
# --------------------------------------------------------------------------------------------

_sdpa_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _sequence_kv_padded(k_src, v_src, b, n, span, block_table, kv_starts):
    """K, V of sequence ``b`` as contiguous ``[H_kv, span, D]`` (``span >= n``), zero past n."""
    out = []
    for src in (k_src, v_src):
        if block_table is not None:
            x = _gather_pages(src, block_table[b], n)  # whole pages, contiguous
        else:
            x = src[kv_starts[b] : kv_starts[b] + n].transpose(0, 1)
        if x.shape[1] >= span:
            x = x[:, :span].contiguous()
        else:
            x = F.pad(x, (0, 0, 0, span - x.shape[1]))
        x[:, n:] = 0  # never read unmasked; zero keeps stale cache contents (NaN) out
        out.append(x)
    return out[0], out[1]


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


_TAIL_MASK_CACHE: dict = {}
# widest off-band list (in keys) attended in one call with the diagonal region; bounds the
# cached mask to groups*BQ x (8192 + BQ) elements
_MAX_ONE_CALL_KEYS = 8192


def _causal_tail_mask(groups, block_q, min_width, dtype, device) -> torch.Tensor:
    """Additive mask ``[1, 1, groups*BQ, W + BQ]``: ``W >= min_width`` free columns, then a
    causal ``BQ x BQ`` block (repeated for the ``groups`` stacked heads). Its last
    ``w + BQ`` columns are the mask for ``w`` off-band keys; one tensor per shape is kept and
    grown on demand."""
    key = (groups, block_q, dtype, str(device))
    cached = _TAIL_MASK_CACHE.get(key)
    if cached is None or cached.shape[-1] - block_q < min_width:
        width = max(min_width, 2 * (cached.shape[-1] - block_q) if cached is not None else 0)
        tril = torch.ones(block_q, block_q, dtype=torch.bool, device=device).tril()
        allowed = torch.cat([tril.new_ones(block_q, width), tril], dim=1).repeat(groups, 1)
        cached = _additive_mask(allowed, dtype)[None, None]
        _TAIL_MASK_CACHE[key] = cached
    return cached


def _block_sparse_attention_torch(
    query, k_src, v_src, selection, block_table, kv_starts, scale, out, chunk_bytes=64 << 20
) -> torch.Tensor:
    """CPU path: a few batched SDPA calls per sequence, never a loop over key blocks.

    Query block ``m`` attends to its selected *off-band* key blocks (left of ``m*BQ``) and to
    its *diagonal region*, keys ``[m*BQ, (m+1)*BQ)`` (the key blocks under it, which the
    scoring step always selects; ``BQ`` must be a multiple of ``BK``). Consecutive query blocks
    are batched into runs (see ``_attend_sequence_batched``). Query blocks whose diagonal
    region is not fully selected (hand-made selections; the first block of a chunk whose
    context ends inside it, when the local window does not reach back to ``m*BQ``) are redone
    with one masked SDPA call each (``_attend_generic``).
    """
    qb = selection.query_blocks
    BQ, BK = qb.block_size, selection.key_block_size
    _, num_q_heads, head_dim = query.shape
    num_kv_heads = k_src.shape[-2]
    num_sel = selection.num_heads
    kv_group, sel_group = _check_heads(num_q_heads, num_kv_heads, num_sel)
    device = query.device
    sel_kv_head = (torch.arange(num_sel, device=device) * sel_group) // kv_group
    indices = selection.block_indices.to(device)
    counts = selection.block_counts.to(device)
    batched = _sdpa_with_lse is not None and device.type == "cpu" and BQ % BK == 0
    q_offset = 0
    for b, (n, ql) in enumerate(zip(qb.seq_lens, qb.query_lens)):
        if ql == 0:
            continue
        ctx = n - ql
        rows = selection.rows_of_sequence(b)
        m0, nqb = ctx // BQ, rows.stop - rows.start
        span = max((m0 + nqb) * BQ, -(-n // BK) * BK)  # whole query blocks and key blocks
        k_seq, v_seq = _sequence_kv_padded(k_src, v_src, b, n, span, block_table, kv_starts)
        q_seq = query[q_offset : q_offset + ql]
        o_seq = out[q_offset : q_offset + ql]
        if batched:
            redo = _attend_sequence_batched(
                q_seq, o_seq, k_seq, v_seq, indices[rows], counts[rows], sel_kv_head, ctx, n,
                m0, nqb, BQ, BK, scale, chunk_bytes,
            )
        else:
            redo = range(nqb)
        for j in redo:
            m = m0 + j
            p0, p1 = max(m * BQ, ctx), min((m + 1) * BQ, n)
            q_t = q_seq[p0 - ctx : p1 - ctx].permute(1, 0, 2).reshape(
                1, num_sel, sel_group * (p1 - p0), head_dim)
            o = _attend_generic(q_t, k_seq, v_seq, indices[rows.start + j],
                                counts[rows.start + j], sel_kv_head, p0, p1, BK, scale)
            o_seq[p0 - ctx : p1 - ctx] = o.view(num_q_heads, p1 - p0, head_dim).transpose(0, 1)
        q_offset += ql
    return out


def _attend_sequence_batched(q_seq, o_seq, k_seq, v_seq, indices, counts, sel_kv_head, ctx, n,
                             m0, nqb, BQ, BK, scale, chunk_bytes) -> list[int]:
    """Batched attention of one sequence's query blocks; returns the query blocks to redo.

    Consecutive query blocks are processed in *runs* (bounded by ``chunk_bytes`` of gathered
    K/V). In a run where every head of every block has the same number ``w`` of off-band
    blocks (the usual case under a top-k/density budget), each (block, head) attends to its
    ``w`` gathered off-band blocks followed by its diagonal region: one SDPA call whose mask,
    causal on the last ``BQ`` keys only, is shared by all blocks and heads. Other runs take two
    calls (diagonal region; off-band blocks with a padding mask) merged by log-sum-exp.
    """
    ql, num_q_heads, head_dim = q_seq.shape
    num_sel = indices.shape[1]
    sel_group = num_q_heads // num_sel
    device, dtype = q_seq.device, q_seq.dtype
    kv_heads = k_seq.shape[0]
    per_q = BQ // BK  # key blocks under one query block (its diagonal region)
    m = m0 + torch.arange(nqb, device=device)
    band0 = (m * per_q)[:, None, None]
    slot = torch.arange(indices.shape[-1], device=device)[None, None, :]
    n_off = ((slot < counts[..., None]) & (indices < band0)).sum(-1)  # [nqb, S], leading entries
    last_kb = (torch.clamp((m + 1) * BQ, max=n) - 1) // BK
    need = (last_kb - m * per_q + 1)[:, None]
    diag_ok = ((counts - n_off) == need).all(-1)  # whole diagonal region selected
    uniform = (n_off == n_off[:, :1]).all(-1)
    diag_ok_h, uniform_h = diag_ok.tolist(), uniform.tolist()
    widest_h = n_off.max(-1).values.tolist()

    # queries at absolute positions m0*BQ .. (m0+nqb)*BQ, zero outside the chunk;
    # [nqb, S, G*BQ, D] with the G query heads of a selection head stacked along the rows
    aligned = ctx == m0 * BQ and ql == nqb * BQ
    if aligned:
        qp = q_seq
    else:
        qp = q_seq.new_zeros(nqb * BQ, num_q_heads, head_dim)
        qp[ctx - m0 * BQ : ctx - m0 * BQ + ql] = q_seq
    q_t = qp.view(nqb, BQ, num_sel, sel_group, head_dim).permute(0, 2, 3, 1, 4).reshape(
        nqb, num_sel, sel_group * BQ, head_dim)
    o = torch.empty_like(q_t)  # blocks not computed here are redone by the caller

    nkb = k_seq.shape[1] // BK
    k_blocks = k_seq[:, : nkb * BK].reshape(kv_heads * nkb, BK * head_dim)
    v_blocks = v_seq[:, : nkb * BK].reshape(kv_heads * nkb, BK * head_dim)
    bytes_per_block = 2 * num_sel * BK * head_dim * k_seq.element_size()
    one_call_max = _MAX_ONE_CALL_KEYS // BK  # wider uniform runs take the two-call path
    tail = _causal_tail_mask(sel_group, BQ, min(max(widest_h), one_call_max) * BK, dtype, device)

    def causal_tail(w):  # [1, 1, G*BQ, w*BK + BQ]: all off-band keys, causal diagonal region
        return tail[:, :, :, tail.shape[-1] - w * BK - BQ :]

    def gather(blocks):  # [c, S, nb] key-block ids -> K, V [c, S, nb*BK, D]
        c, _, nb = blocks.shape
        flat = (sel_kv_head[None, :, None] * nkb + blocks).flatten()
        shape = (c, num_sel, nb * BK, head_dim)
        return k_blocks.index_select(0, flat).view(shape), v_blocks.index_select(0, flat).view(
            shape)

    j0 = 0
    while j0 < nqb:
        if not diag_ok_h[j0]:
            j0 += 1
            continue
        key = (uniform_h[j0], widest_h[j0] if uniform_h[j0] else None)
        j1, widest = j0 + 1, widest_h[j0]
        while (j1 < nqb and diag_ok_h[j1] and (uniform_h[j1], widest_h[j1] if uniform_h[j1]
                                                else None) == key
               and (max(widest, widest_h[j1]) + per_q) * (j1 - j0 + 1) * bytes_per_block
               <= chunk_bytes):
            widest = max(widest, widest_h[j1])
            j1 += 1
        diag = (m[j0:j1, None, None] * per_q + torch.arange(per_q, device=device)).expand(
            -1, num_sel, -1)
        if key[0] and widest <= one_call_max:  # one call: [off-band blocks, diagonal region]
            blk = torch.cat([indices[j0:j1, :, :widest].long(), diag], dim=-1)
            k_g, v_g = gather(blk)
            o[j0:j1] = _sdpa_with_lse(q_t[j0:j1], k_g, v_g, 0.0, False,
                                      attn_mask=causal_tail(widest), scale=scale)[0]
        else:  # ragged run: diagonal and off-band separately, merged by log-sum-exp
            k_d, v_d = gather(diag)
            o_d, lse_d = _sdpa_with_lse(q_t[j0:j1], k_d, v_d, 0.0, False,
                                        attn_mask=causal_tail(0), scale=scale)
            off = n_off[j0:j1]
            blk = indices[j0:j1, :, :widest].long().clamp_min(0)  # -1 pads -> block 0, masked
            k_o, v_o = gather(blk)
            pad_mask = None
            if bool((off != widest).any()):  # heads/blocks with fewer blocks: hide the padding
                keep = torch.arange(widest, device=device)[None, None, :] < off[..., None]
                pad_mask = _additive_mask(keep.repeat_interleave(BK, -1)[:, :, None, :], dtype)
            o_o, lse_o = _sdpa_with_lse(q_t[j0:j1], k_o, v_o, 0.0, False, attn_mask=pad_mask,
                                        scale=scale)
            # heads without off-band blocks contribute nothing (SDPA reports lse 0 for them)
            lse_o = lse_o.masked_fill((off == 0)[..., None], float("-inf"))
            lse_t = torch.logaddexp(lse_d, lse_o)
            o[j0:j1] = (o_d.float() * torch.exp(lse_d - lse_t)[..., None]
                        + o_o.float() * torch.exp(lse_o - lse_t)[..., None]).to(dtype)
        j0 = j1
    # [nqb, S, G*BQ, D] -> [nqb*BQ, Hq, D], rows of this chunk only
    o = o.view(nqb, num_q_heads, BQ, head_dim).transpose(1, 2)
    if aligned:
        o_seq.view(nqb, BQ, num_q_heads, head_dim).copy_(o)
    else:
        o_seq.copy_(o.reshape(nqb * BQ, num_q_heads, head_dim)[ctx - m0 * BQ : ctx - m0 * BQ + ql])
    return [j for j in range(nqb) if not diag_ok_h[j]]


def _attend_generic(q_t, k_seq, v_seq, blocks_r, counts, sel_kv_head, p0, p1, BK, scale):
    """One masked SDPA call over all selected blocks (any selection; slower masks)."""
    num_sel = q_t.shape[1]
    device = q_t.device
    rows = p1 - p0
    sel_group = q_t.shape[2] // rows
    max_count = int(counts.max())
    if max_count == 0:
        return torch.zeros_like(q_t)
    blocks = blocks_r[:, :max_count].long()
    valid = torch.arange(max_count, device=device)[None, :] < counts[:, None].to(device)
    blocks = torch.where(valid, blocks, 0)
    k_pos = (blocks[:, :, None] * BK + torch.arange(BK, device=device)).reshape(num_sel, -1)
    k_g = k_seq[sel_kv_head[:, None], k_pos]  # [S, L, D]
    v_g = v_seq[sel_kv_head[:, None], k_pos]
    key_ok = valid[:, :, None].expand(-1, -1, BK).reshape(num_sel, -1)
    q_pos = torch.arange(p0, p1, device=device)
    allowed = key_ok[:, None, :] & (k_pos[:, None, :] <= q_pos[None, :, None])
    allowed = allowed.repeat(1, sel_group, 1)[None]
    o = F.scaled_dot_product_attention(q_t, k_g[None], v_g[None], attn_mask=allowed, scale=scale)
    # a row that sees no key gives NaN in SDPA; the kernel and the reference give 0
    return o.masked_fill(~allowed.any(-1, keepdim=True), 0.0)


# --------------------------------------------------------------------------------------------
# Triton kernel (GPU; CPU under TRITON_INTERPRET=1)
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _attend_key_block(
        acc, l_i, m_i, q, q_pos, kb,
        K, V, bt_row, kv_base, seq_len, kv_head,
        stride_kp, stride_kt, stride_kh, stride_kd,
        stride_vp, stride_vt, stride_vh, stride_vd,
        qk_scale,
        PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        """Online-softmax update of one query tile with key block ``kb``."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        k_pos = kb * BLOCK_N + offs_n
        if PAGED:
            if PAGE_SIZE % BLOCK_N == 0:  # the whole key block lies in one page
                page = tl.load(bt_row + (kb * BLOCK_N) // PAGE_SIZE).to(tl.int64)
                in_page = (kb * BLOCK_N) % PAGE_SIZE + offs_n
                k_rows = page * stride_kp + in_page * stride_kt
                v_rows = page * stride_vp + in_page * stride_vt
            else:  # the key block spans several pages: one page id per key
                page = tl.load(bt_row + k_pos // PAGE_SIZE, mask=k_pos < seq_len, other=0)
                page = page.to(tl.int64)
                in_page = k_pos % PAGE_SIZE
                k_rows = page * stride_kp + in_page * stride_kt
                v_rows = page * stride_vp + in_page * stride_vt
        else:
            tok = (kv_base + k_pos).to(tl.int64)
            k_rows = tok * stride_kt
            v_rows = tok * stride_vt
        k_ptrs = K + kv_head * stride_kh + k_rows[None, :] + offs_d[:, None] * stride_kd
        v_ptrs = V + kv_head * stride_vh + v_rows[:, None] + offs_d[None, :] * stride_vd
        if MASKED:
            key_ok = k_pos < seq_len
            if BLOCK_D == HEAD_DIM:
                k = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
            else:
                d_ok = offs_d < HEAD_DIM
                k = tl.load(k_ptrs, mask=key_ok[None, :] & d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            if BLOCK_D == HEAD_DIM:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            else:
                d_ok = offs_d < HEAD_DIM
                k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        qk = tl.dot(q, k) * qk_scale  # log2 domain
        if MASKED:
            qk = tl.where(k_pos[None, :] <= q_pos[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, l_i, m_new

    @triton.jit
    def _block_sparse_attention_kernel(
        Q, K, V, O,  # noqa: E741 (the usual names of attention operands)
        block_table, kv_start_loc, seq_lens, query_start_loc,
        qb_seq, qb_index, sel_indices, sel_counts, sel_offband,
        stride_qt, stride_qh, stride_qd,
        stride_kp, stride_kt, stride_kh, stride_kd,
        stride_vp, stride_vt, stride_vh, stride_vd,
        stride_ot, stride_oh, stride_od,
        stride_bt,
        stride_si_q, stride_si_h, stride_sc_q, stride_sc_h,
        qk_scale, num_query_blocks,
        KV_GROUP: tl.constexpr, SEL_GROUP: tl.constexpr,
        PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        head = tl.program_id(0)
        qb = num_query_blocks - 1 - tl.program_id(1)  # long (late) query blocks first
        seq = tl.load(qb_seq + qb)
        m = tl.load(qb_index + qb)
        seq_len = tl.load(seq_lens + seq)
        q_start = tl.load(query_start_loc + seq)
        q_len = tl.load(query_start_loc + seq + 1) - q_start
        ctx = seq_len - q_len
        kv_head = head // KV_GROUP
        sel_head = head // SEL_GROUP

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q_pos = m * BLOCK_M + offs_m
        q_ok = (q_pos >= ctx) & (q_pos < seq_len)
        q_rows = (q_start + q_pos - ctx).to(tl.int64)
        q_mask = q_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(
            Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
            mask=q_mask, other=0.0,
        )

        if PAGED:
            bt_row = block_table + seq.to(tl.int64) * stride_bt
            kv_base = 0
        else:
            bt_row = block_table
            kv_base = tl.load(kv_start_loc + seq)

        # finite start value: a row that sees no key ends with l_i == 0 instead of NaN
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        count = tl.load(sel_counts + qb * stride_sc_q + sel_head * stride_sc_h)
        n_off = tl.load(sel_offband + qb * stride_sc_q + sel_head * stride_sc_h)
        idx_ptr = sel_indices + qb.to(tl.int64) * stride_si_q + sel_head * stride_si_h
        # stage 1: key blocks entirely left of the diagonal, no mask
        for n in range(0, n_off):
            kb = tl.load(idx_ptr + n)
            acc, l_i, m_i = _attend_key_block(
                acc, l_i, m_i, q, q_pos, kb, K, V, bt_row, kv_base, seq_len, kv_head,
                stride_kp, stride_kt, stride_kh, stride_kd,
                stride_vp, stride_vt, stride_vh, stride_vd, qk_scale,
                PAGED, PAGE_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, False,
            )
        # stage 2: blocks the causal boundary crosses
        for n in range(n_off, count):
            kb = tl.load(idx_ptr + n)
            acc, l_i, m_i = _attend_key_block(
                acc, l_i, m_i, q, q_pos, kb, K, V, bt_row, kv_base, seq_len, kv_head,
                stride_kp, stride_kt, stride_kh, stride_kd,
                stride_vp, stride_vt, stride_vh, stride_vd, qk_scale,
                PAGED, PAGE_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, True,
            )
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_i[:, None]
        tl.store(
            O + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
            o.to(O.dtype.element_ty), mask=q_mask,
        )


def _default_launch_config(block_m: int, head_dim: int) -> tuple[int, int]:
    """(num_warps, num_stages) that suit Hopper/Ampere for the tile sizes used here."""
    num_warps = 8 if block_m >= 128 else 4
    num_stages = 2 if head_dim > 128 else 3
    return num_warps, num_stages


def _block_sparse_attention_triton(
    query, k_src, v_src, selection, block_table, kv_start_loc, seq_lens, query_start_loc,
    scale, out, num_warps=None, num_stages=None,
):
    qb = selection.query_blocks
    _, num_q_heads, head_dim = query.shape
    num_kv_heads = k_src.shape[-2]
    kv_group, sel_group = _check_heads(num_q_heads, num_kv_heads, selection.num_heads)
    if not (isinstance(k_src, torch.Tensor) and isinstance(v_src, torch.Tensor)):
        raise TypeError("the Triton path needs strided K/V views (packed CPU pages: use torch)")
    if qb.num_blocks == 0:
        return out
    BM, BN = qb.block_size, selection.key_block_size
    BD = max(next_power_of_2(head_dim), 16)
    if BM < 16 or BN < 16 or BM & (BM - 1) or BN & (BN - 1):
        raise ValueError(f"Triton path needs power-of-2 blocks >= 16, got {BM}x{BN}")
    paged = block_table is not None
    device = query.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int32)
    query_start_loc = query_start_loc.to(device=device, dtype=torch.int32)
    if paged:
        block_table = block_table.to(device=device, dtype=torch.int32)
        kv_start_loc = seq_lens  # unused
        stride_kp, stride_kt, stride_kh, stride_kd = k_src.stride()
        stride_vp, stride_vt, stride_vh, stride_vd = v_src.stride()
        page_size, stride_bt = k_src.shape[1], block_table.stride(0)
    else:
        kv_start_loc = kv_start_loc.to(device=device, dtype=torch.int32)
        block_table = kv_start_loc  # unused
        stride_kp, (stride_kt, stride_kh, stride_kd) = 0, k_src.stride()
        stride_vp, (stride_vt, stride_vh, stride_vd) = 0, v_src.stride()
        page_size, stride_bt = 1, 0
    indices = selection.block_indices.to(device=device, dtype=torch.int32)
    counts = selection.block_counts.to(device=device, dtype=torch.int32).contiguous()
    offband = selection.num_offband.to(device=device, dtype=torch.int32).contiguous()
    w, s = _default_launch_config(BM, head_dim)
    grid = (num_q_heads, qb.num_blocks)
    _block_sparse_attention_kernel[grid](
        query, k_src, v_src, out,
        block_table, kv_start_loc, seq_lens, query_start_loc,
        qb.seq.to(device), qb.index.to(device), indices, counts, offband,
        *query.stride(),
        stride_kp, stride_kt, stride_kh, stride_kd,
        stride_vp, stride_vt, stride_vh, stride_vd,
        *out.stride(),
        stride_bt,
        indices.stride(0), indices.stride(1), counts.stride(0), counts.stride(1),
        scale * 1.4426950408889634, qb.num_blocks,
        KV_GROUP=kv_group, SEL_GROUP=sel_group,
        PAGED=paged, PAGE_SIZE=page_size,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, HEAD_DIM=head_dim,
        num_warps=num_warps or w, num_stages=num_stages or s,
    )
    return out


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def _choose_backend(backend: str, query: torch.Tensor) -> str:
    return choose_backend(backend, query, ("triton", "torch", "reference"))


def block_sparse_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    selection: BlockSelection,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Block-sparse causal attention of a prefill chunk over a paged KV cache.

    Args:
        query: ``[T, Hq, D]`` queries of the new tokens of all sequences (varlen).
        k_cache, v_cache: ``[num_pages, page_size, H_kv, D]`` views (see ``kv_cache_views_*``);
            they already hold the K/V of the prior context and of the new tokens.
        selection: the plan (``block_scoring.select_blocks`` or ``BlockSelection.from_mask``),
            built for the same ``seq_lens``/``query_start_loc``.
        block_table: ``[B, max_pages]`` page ids per sequence.
        seq_lens: ``[B]`` context + new tokens; ``query_start_loc``: ``[B+1]``.
        scale: softmax scale (default ``D ** -0.5``).
        out: optional ``[T, Hq, D]`` output (written in place).
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"``, ``"torch"``,
            ``"reference"``.
    """
    head_dim = query.shape[-1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    if out is None:
        out = torch.empty_like(query)
    backend = _choose_backend(backend, query)
    if backend == "triton":
        return _block_sparse_attention_triton(
            query, k_cache, v_cache, selection, block_table, None, seq_lens, query_start_loc,
            scale, out,
        )
    if backend == "reference":
        out.copy_(block_sparse_attention_reference(
            query, k_cache, v_cache, selection, block_table, seq_lens, query_start_loc,
            scale=scale,
        ))
        return out
    return _block_sparse_attention_torch(
        query, k_cache, v_cache, selection, block_table, None, scale, out
    )


def block_sparse_attention_contiguous(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: BlockSelection,
    query_start_loc: torch.Tensor,
    kv_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Same as ``block_sparse_attention`` with contiguous varlen K/V instead of pages.

    ``q [Tq, Hq, D]`` (``query_start_loc [B+1]``), ``k, v [Tk, H_kv, D]`` (``kv_start_loc
    [B+1]``); sequence ``b`` has ``seq_len = kv_start_loc[b+1] - kv_start_loc[b]`` keys and its
    queries are its last ``q_len`` positions.
    """
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    if out is None:
        out = torch.empty_like(q)
    seq_lens = kv_start_loc[1:] - kv_start_loc[:-1]
    backend = _choose_backend(backend, q)
    if backend == "triton":
        return _block_sparse_attention_triton(
            q, k, v, selection, None, kv_start_loc, seq_lens, query_start_loc, scale, out,
            num_warps=num_warps, num_stages=num_stages,
        )
    if backend == "reference":
        out.copy_(block_sparse_attention_reference(
            q, k, v, selection, None, seq_lens, query_start_loc, kv_start_loc=kv_start_loc,
            scale=scale,
        ))
        return out
    kv_starts = [int(x) for x in kv_start_loc.tolist()]
    return _block_sparse_attention_torch(q, k, v, selection, None, kv_starts, scale, out)


def attention_flops(selection: BlockSelection, num_q_heads: int, head_dim: int) -> float:
    """FLOPs of the computed blocks: ``4 * BQ * BK * D`` per selected (block pair, query head)."""
    sel_group = num_q_heads // selection.num_heads
    pairs = float(selection.block_counts.sum()) * sel_group
    return 4.0 * selection.query_block_size * selection.key_block_size * head_dim * pairs


def dense_causal_flops(seq_len: int, num_q_heads: int, head_dim: int) -> float:
    """FLOPs of dense causal attention of one sequence (half of the full square)."""
    return 4.0 * seq_len * seq_len / 2 * head_dim * num_q_heads

