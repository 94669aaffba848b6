"""Kernel tests run Triton kernels in the CPU interpreter; helpers build paged test batches.

``TRITON_INTERPRET`` must be set before ``triton`` decorates the kernels (at import of the
kernel modules), hence here, before any test module of this folder is imported.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_accel.kernels import block_sparse_attention as bsa  # noqa: E402
from vllm_accel.kernels.kivi_cache import quantize_on_write, tail_entries  # noqa: E402


def triton_interpreted() -> bool:
    """True when the Triton kernel of this process runs in the interpreter (CPU tensors)."""
    kernel = getattr(bsa, "_block_sparse_attention_kernel", None)
    return kernel is not None and type(kernel).__name__ == "InterpretedFunction"


requires_triton_interpreter = pytest.mark.skipif(
    not triton_interpreted(),
    reason="Triton missing, or imported before TRITON_INTERPRET=1 was set",
)


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_pages, page, Hkv, D] view
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    keys: list  # per sequence [n, Hkv, D]
    values: list
    k_flat: torch.Tensor  # contiguous varlen keys [sum n, Hkv, D]
    v_flat: torch.Tensor
    kv_start_loc: torch.Tensor  # [B+1]


def make_paged_batch(
    seq_lens, query_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=32,
    layout="cpu", dtype=torch.float32, seed=0,
) -> PagedBatch:
    """Random varlen batch whose K/V live in a paged cache with shuffled page ids.

    ``layout='cpu'``: vLLM CPU pages as the ``vec`` ISA packs them (per (page, head) a K tile
    stored transposed, then a V tile); ``layout='kv_last'``: vLLM CUDA pages (K|V in the last
    dim, NHD physical order).
    """
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    query = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=g).to(dtype)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3
    perm = torch.randperm(num_pages, generator=g)
    block_table = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32)
    if layout == "cpu":
        storage = torch.zeros(num_pages, num_kv_heads, page_size, 2 * head_dim, dtype=dtype)
        k_cache, v_cache = bsa.kv_cache_views_cpu(storage, isa="vec")
    elif layout == "kv_last":
        physical = torch.zeros(num_pages, page_size, num_kv_heads, 2 * head_dim, dtype=dtype)
        k_cache, v_cache = bsa.kv_cache_views_split_last_dim(physical.transpose(1, 2))
    else:
        raise ValueError(layout)
    used = 0
    for b, n in enumerate(seq_lens):
        for p in range(pages_per_seq[b]):
            page = int(perm[used])
            used += 1
            block_table[b, p] = page
            lo, hi = p * page_size, min(n, (p + 1) * page_size)
            k_cache[page, : hi - lo] = keys[b][lo:hi]
            v_cache[page, : hi - lo] = values[b][lo:hi]
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    ksl = torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0).tolist()), dtype=torch.int32)
    return PagedBatch(
        query=query, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl,
        keys=keys, values=values, k_flat=torch.cat(keys), v_flat=torch.cat(values),
        kv_start_loc=ksl,
    )


def dense_causal_attention(batch: PagedBatch, scale=None) -> torch.Tensor:
    """fp32 dense causal attention of the new tokens over context + new keys."""
    out = torch.zeros(batch.query.shape, dtype=torch.float32)
    qsl = batch.query_start_loc.tolist()
    for b, n in enumerate(batch.seq_lens.tolist()):
        ql = qsl[b + 1] - qsl[b]
        q = batch.query[qsl[b] : qsl[b + 1]].float().transpose(0, 1)
        k = batch.keys[b].float().transpose(0, 1)
        v = batch.values[b].float().transpose(0, 1)
        g = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        q_pos = torch.arange(n - ql, n)
        mask = torch.arange(n)[None, :] <= q_pos[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[qsl[b] : qsl[b + 1]] = o.transpose(0, 1)
    return out


def filled_kivi_cache(layout, seq_lens, hkv, seed=0, kv=None):
    """Sequences written token by token-chunks into scattered pages; returns cache, tail,
    block table and the tail index of each sequence. ``kv``: the sequences' keys and values
    ``[sum(seq_lens), hkv, D]`` (default: random, with an outlier key channel)."""
    gen = torch.Generator().manual_seed(seed)
    n = layout.block_size
    pages_per_seq = [-(-s // n) for s in seq_lens]
    perm = torch.randperm(sum(pages_per_seq) + 1, generator=gen)[1:]  # page 0 unused
    width = max(pages_per_seq)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    start = 0
    for i, p in enumerate(pages_per_seq):
        table[i, :p] = perm[start:start + p].to(torch.int32)
        start += p
    cache = layout.allocate(sum(pages_per_seq) + 1, hkv)
    tail = layout.allocate_tail(2 * len(seq_lens), hkv)
    lens = torch.tensor(seq_lens)
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    tail_mapping, tail_index = tail_entries(qsl, lens, layout.key_group)
    slots = torch.cat([table[i, torch.arange(s) // n].long() * n + torch.arange(s) % n
                       for i, s in enumerate(seq_lens)])
    if kv is None:
        k = torch.randn(int(qsl[-1]), hkv, layout.head_size, generator=gen)
        k[:, :, 3] *= 8  # an outlier channel
        v = torch.randn(int(qsl[-1]), hkv, layout.head_size, generator=gen)
    else:
        k, v = kv
    quantize_on_write(k.bfloat16(), v.bfloat16(), cache, slots, layout,
                      **({"k_tail": tail, "tail_mapping": tail_mapping}
                         if layout.residual == "tail" else {}))
    return cache, tail, table, tail_index
