"""Upper-layer attention of SPEED (shallow prefill, deep decode) over a paged KV cache.

In SPEED's upper layers only the *upper-active* tokens of a request exist: the first
``anchor_tokens`` positions, the last prompt position ``P - 1`` and every decode token
(:mod:`vllm_accel.speed.policy`). A query at position ``q`` attends to the upper-active keys at
positions ``<= q``: ``{0 .. anchor-1} ∪ {P-1 .. q}``. The pages between the anchor page and the
page of ``P - 1`` hold nothing (vLLM's block manager gives them the null block), so a dense
paged kernel cannot be used as is: it would read them.

:func:`speed_upper_attention` gathers, per request, only the pages that can hold visible keys
(the anchor page(s) and the pages from ``P - 1`` to the end), masks positions inside them that
are not visible, and runs one batched ``scaled_dot_product_attention`` (GQA native). The visible
set is small (anchor + decoded tokens), so the gather is cheap; the cost does not grow with the
prompt. :func:`speed_upper_attention_reference` is the per-token float64 definition.

Pure torch; the page views come from ``block_sparse_attention.kv_cache_views_cpu`` (any object
with ``index_select(0, pages) -> [n, page_size, H_kv, D]`` works, e.g. packed AMX pages).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def upper_active(positions: torch.Tensor, prompt_lens: torch.Tensor,
                 anchor_tokens: int) -> torch.Tensor:
    """Bool mask: tokens at ``positions`` (with their request's ``prompt_lens``) that run the
    upper layers."""
    return (positions < anchor_tokens) | (positions >= prompt_lens - 1)


def _request_pages(seq_len: int, prompt_len: int, anchor_tokens: int,
                   page_size: int) -> list[int]:
    """Logical pages of one request that can hold an upper-active key."""
    if seq_len <= 0:
        return []
    anchor_pages = range(0, (min(anchor_tokens, seq_len) - 1) // page_size + 1)
    tail_start = max(prompt_len - 1, 0)
    tail_pages = range(tail_start // page_size, (seq_len - 1) // page_size + 1)
    return sorted(set(anchor_pages) | set(tail_pages))


def speed_upper_attention(
    query: torch.Tensor,  # [T, H_q, D]
    query_positions: torch.Tensor,  # [T] absolute positions
    query_start_loc: list[int],  # [R + 1] rows of each request in ``query``
    key_pages,  # [num_pages, page_size, H_kv, D] (view or PackedKVPages)
    value_pages,
    block_table: torch.Tensor,  # [R, max_pages] physical page of each logical page
    seq_lens: list[int],  # [R] keys of each request (context + new tokens)
    prompt_lens: list[int],  # [R]
    anchor_tokens: int,
    scale: float,
) -> torch.Tensor:
    """SPEED upper-layer attention for ``R`` requests; returns ``[T, H_q, D]``."""
    num_reqs = len(seq_lens)
    page_size = key_pages.shape[1]
    out = query.new_empty(query.shape)
    if query.shape[0] == 0:
        return out
    pages = [_request_pages(seq_lens[r], prompt_lens[r], anchor_tokens, page_size)
             for r in range(num_reqs)]
    q_lens = [query_start_loc[r + 1] - query_start_loc[r] for r in range(num_reqs)]
    active = [r for r in range(num_reqs) if q_lens[r] > 0]
    max_pages = max(len(pages[r]) for r in active)
    max_q = max(q_lens[r] for r in active)
    n = len(active)
    device = query.device

    logical = torch.full((n, max_pages), -1, dtype=torch.long)
    for i, r in enumerate(active):
        logical[i, : len(pages[r])] = torch.tensor(pages[r], dtype=torch.long)
    valid_page = logical >= 0
    rows = torch.tensor(active, dtype=torch.long)
    physical = block_table.index_select(0, rows.to(block_table.device)).long().cpu()
    physical = torch.where(valid_page, physical.gather(1, logical.clamp(min=0)), 0)
    flat = physical.reshape(-1).to(device)
    num_kv_heads, head_dim = key_pages.shape[2], key_pages.shape[3]
    k = key_pages.index_select(0, flat).reshape(n, max_pages * page_size, num_kv_heads, head_dim)
    v = value_pages.index_select(0, flat).reshape(n, max_pages * page_size, num_kv_heads,
                                                  head_dim)

    # key positions and their visibility
    offsets = torch.arange(page_size)
    key_pos = (logical.unsqueeze(-1) * page_size + offsets).reshape(n, -1)  # [n, max_keys]
    prompt = torch.tensor([prompt_lens[r] for r in active]).unsqueeze(1)
    seq = torch.tensor([seq_lens[r] for r in active]).unsqueeze(1)
    key_ok = (valid_page.repeat_interleave(page_size, dim=1) & (key_pos < seq)
              & upper_active(key_pos, prompt, anchor_tokens))
    # Masked slots (unwritten positions, padding pages -> the null page) may hold anything,
    # and a masked NaN still poisons softmax(..) @ V: zero them.
    hidden = ~key_ok.to(device)[:, :, None, None]
    k, v = k.masked_fill(hidden, 0), v.masked_fill(hidden, 0)

    # queries, padded per request; padding rows see every valid key (no NaN) and are dropped
    q_index = torch.full((n, max_q), -1, dtype=torch.long)
    for i, r in enumerate(active):
        q_index[i, : q_lens[r]] = torch.arange(query_start_loc[r], query_start_loc[r + 1])
    q_valid = q_index >= 0
    q_pos = torch.where(q_valid, query_positions.cpu()[q_index.clamp(min=0)],
                        torch.iinfo(torch.long).max)
    mask = key_ok.unsqueeze(1) & (key_pos.unsqueeze(1) <= q_pos.unsqueeze(2))  # [n, max_q, K]
    q = query.index_select(0, q_index.clamp(min=0).reshape(-1).to(device))
    q = q.reshape(n, max_q, *query.shape[1:]).transpose(1, 2)  # [n, H_q, max_q, D]
    o = F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.unsqueeze(1).to(device),
        scale=scale, enable_gqa=q.shape[1] != num_kv_heads)
    o = o.transpose(1, 2).reshape(n * max_q, *query.shape[1:])
    keep = q_valid.reshape(-1)
    out.index_copy_(0, q_index.reshape(-1)[keep].to(device),
                    o[keep.to(device)].to(out.dtype))
    return out


def speed_upper_attention_reference(
    query: torch.Tensor,  # [T, H_q, D]
    query_positions: torch.Tensor,  # [T]
    query_start_loc: list[int],
    keys: list[torch.Tensor],  # per request [seq_len, H_kv, D], every position
    values: list[torch.Tensor],
    prompt_lens: list[int],
    anchor_tokens: int,
    scale: float,
) -> torch.Tensor:
    """Definition: each query row, in float64, over the visible keys only."""
    out = torch.empty(query.shape, dtype=torch.float64)
    group = query.shape[1] // keys[0].shape[1] if keys else 1
    for r in range(len(keys)):
        for t in range(query_start_loc[r], query_start_loc[r + 1]):
            qp = int(query_positions[t])
            visible = [p for p in range(keys[r].shape[0])
                       if p <= qp and (p < anchor_tokens or p >= prompt_lens[r] - 1)]
            k = keys[r][visible].double().repeat_interleave(group, dim=1)  # [n, H_q, D]
            v = values[r][visible].double().repeat_interleave(group, dim=1)
            s = torch.einsum("hd,nhd->hn", query[t].double(), k) * scale
            out[t] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out
