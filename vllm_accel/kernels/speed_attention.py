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

The torch path takes the page views of ``block_sparse_attention.kv_cache_views_cpu`` (any object
with ``index_select(0, pages) -> [n, page_size, H_kv, D]`` works, e.g. packed AMX pages). The
Triton path (:func:`_speed_upper_attention_triton`, CUDA, or CPU under ``TRITON_INTERPRET=1``)
takes strided page views (e.g. vLLM's flash layout ``kv_cache[0]`` / ``kv_cache[1]``): one
program per (query head, request) walks only the key blocks that can hold visible keys (the
anchor block(s) and the blocks from ``P - 1`` on) with the usual online softmax, so it reads
``O(anchor + decoded)`` keys, never the skipped prompt pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_accel.kernels._triton_utils import (
    HAS_TRITON,
    choose_backend,
    next_power_of_2,
    tl,
    triton,
    triton_interpreter_enabled,
)


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


@dataclass
class SpeedUpperPlan:
    """What :func:`run_speed_upper_attention` needs besides the pages and the queries: it
    depends on the step's metadata only, so one plan serves every upper layer of a step
    (FlashInfer's ``plan()``/``run()`` split)."""

    pages: torch.Tensor  # long [n * max_pages]: physical pages to gather (0 for padding)
    hidden: torch.Tensor  # bool [n, max_pages * page_size, 1, 1]: key slots to zero
    mask: torch.Tensor  # bool [n, 1, max_q, max_keys]: visible keys per query
    q_index: torch.Tensor  # long [n * max_q]: query row of each padded slot (0 for padding)
    keep: torch.Tensor  # bool [n * max_q]: padded slots that are real queries
    out_rows: torch.Tensor  # long [num kept]: where the kept slots go in the output
    num_reqs: int  # requests with queries (n)
    max_q: int


def plan_speed_upper_attention(
    query_positions: torch.Tensor,  # [T] absolute positions
    query_start_loc: list[int],  # [R + 1] rows of each request in ``query``
    block_table: torch.Tensor,  # [R, max_pages] physical page of each logical page
    seq_lens: list[int],  # [R] keys of each request (context + new tokens)
    prompt_lens: list[int],  # [R]
    anchor_tokens: int,
    page_size: int,
    device: torch.device,
) -> SpeedUpperPlan | None:
    """The gather indices and masks of one step (None: no query rows)."""
    num_reqs = len(seq_lens)
    q_lens = [query_start_loc[r + 1] - query_start_loc[r] for r in range(num_reqs)]
    active = [r for r in range(num_reqs) if q_lens[r] > 0]
    if not active:
        return None
    pages = [_request_pages(seq_lens[r], prompt_lens[r], anchor_tokens, page_size)
             for r in range(num_reqs)]
    max_pages = max(len(pages[r]) for r in active)
    max_q = max(q_lens[r] for r in active)
    n = len(active)

    logical = torch.full((n, max_pages), -1, dtype=torch.long)
    for i, r in enumerate(active):
        logical[i, : len(pages[r])] = torch.tensor(pages[r], dtype=torch.long)
    valid_page = logical >= 0
    rows = torch.tensor(active, dtype=torch.long)
    physical = block_table.index_select(0, rows.to(block_table.device)).long().cpu()
    physical = torch.where(valid_page, physical.gather(1, logical.clamp(min=0)), 0)

    # key positions and their visibility
    offsets = torch.arange(page_size)
    key_pos = (logical.unsqueeze(-1) * page_size + offsets).reshape(n, -1)  # [n, max_keys]
    prompt = torch.tensor([prompt_lens[r] for r in active]).unsqueeze(1)
    seq = torch.tensor([seq_lens[r] for r in active]).unsqueeze(1)
    key_ok = (valid_page.repeat_interleave(page_size, dim=1) & (key_pos < seq)
              & upper_active(key_pos, prompt, anchor_tokens))

    # queries, padded per request; padding rows see every valid key (no NaN) and are dropped
    q_index = torch.full((n, max_q), -1, dtype=torch.long)
    for i, r in enumerate(active):
        q_index[i, : q_lens[r]] = torch.arange(query_start_loc[r], query_start_loc[r + 1])
    q_valid = q_index >= 0
    q_pos = torch.where(q_valid, query_positions.cpu()[q_index.clamp(min=0)],
                        torch.iinfo(torch.long).max)
    mask = key_ok.unsqueeze(1) & (key_pos.unsqueeze(1) <= q_pos.unsqueeze(2))  # [n, max_q, K]
    keep = q_valid.reshape(-1)
    return SpeedUpperPlan(
        pages=physical.reshape(-1).to(device),
        # Masked slots (unwritten positions, padding pages -> the null page) may hold
        # anything, and a masked NaN still poisons softmax(..) @ V: they are zeroed.
        hidden=(~key_ok).to(device)[:, :, None, None],
        mask=mask.unsqueeze(1).to(device),
        q_index=q_index.clamp(min=0).reshape(-1).to(device),
        keep=keep.to(device),
        out_rows=q_index.reshape(-1)[keep].to(device),
        num_reqs=n, max_q=max_q)


def run_speed_upper_attention(plan: SpeedUpperPlan | None, query: torch.Tensor, key_pages,
                              value_pages, scale: float) -> torch.Tensor:
    """One layer's upper attention with a step's plan; returns ``[T, H_q, D]``."""
    out = query.new_empty(query.shape)
    if plan is None or query.shape[0] == 0:
        return out
    n, max_q = plan.num_reqs, plan.max_q
    num_kv_heads, head_dim = key_pages.shape[2:4]
    k = key_pages.index_select(0, plan.pages).reshape(n, -1, num_kv_heads, head_dim)
    v = value_pages.index_select(0, plan.pages).reshape(n, -1, num_kv_heads, head_dim)
    k, v = k.masked_fill(plan.hidden, 0), v.masked_fill(plan.hidden, 0)
    q = query.index_select(0, plan.q_index)
    q = q.reshape(n, max_q, *query.shape[1:]).transpose(1, 2)  # [n, H_q, max_q, D]
    o = F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=plan.mask, scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads)
    o = o.transpose(1, 2).reshape(n * max_q, *query.shape[1:])
    out.index_copy_(0, plan.out_rows, o[plan.keep].to(out.dtype))
    return out


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
    backend: str = "auto",
) -> torch.Tensor:
    """SPEED upper-layer attention for ``R`` requests; returns ``[T, H_q, D]``.

    ``backend``: ``"auto"`` (Triton on CUDA, torch otherwise), ``"torch"`` or ``"triton"``.
    The torch path is :func:`plan_speed_upper_attention` then
    :func:`run_speed_upper_attention`; a caller with several layers plans once.
    """
    if choose_backend(backend, query) == "triton":
        return _speed_upper_attention_triton(query, query_positions, query_start_loc,
                                             key_pages, value_pages, block_table, seq_lens,
                                             prompt_lens, anchor_tokens, scale)
    plan = plan_speed_upper_attention(query_positions, query_start_loc, block_table, seq_lens,
                                      prompt_lens, anchor_tokens, key_pages.shape[1],
                                      query.device)
    return run_speed_upper_attention(plan, query, key_pages, value_pages, scale)


if HAS_TRITON:

    @triton.jit
    def _speed_key_block(
        acc, l_i, m_i, q, q_pos, kb, K, V, bt_row, seq_len, anchor, tail, kv_head,
        stride_kp, stride_kt, stride_kh, stride_kd,
        stride_vp, stride_vt, stride_vh, stride_vd,
        qk_scale,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        """Online-softmax update of one query tile with the visible keys of key block ``kb``."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        k_pos = kb * BLOCK_N + offs_n
        visible = (k_pos < seq_len) & ((k_pos < anchor) | (k_pos >= tail))
        # one page id per key: a block may span pages, and skipped pages are the null block
        page = tl.load(bt_row + k_pos // PAGE_SIZE, mask=visible, other=0).to(tl.int64)
        in_page = k_pos % PAGE_SIZE
        d_ok = offs_d < HEAD_DIM
        k = tl.load(K + kv_head * stride_kh + (page * stride_kp + in_page * stride_kt)[None, :]
                    + offs_d[:, None] * stride_kd,
                    mask=visible[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(V + kv_head * stride_vh + (page * stride_vp + in_page * stride_vt)[:, None]
                    + offs_d[None, :] * stride_vd,
                    mask=visible[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:  # fp32 operands, or the interpreter (its bf16 tl.dot is wrong in triton 3.9)
            qk = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            qk = tl.dot(q, k)
        qk = qk * qk_scale  # log2 domain
        qk = tl.where(visible[None, :] & (k_pos[None, :] <= q_pos[:, None]), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DOT_F32:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, l_i, m_new

    @triton.jit
    def _speed_upper_attention_kernel(
        Q, K, V, O,  # noqa: E741 (the usual names of attention operands)
        query_positions, query_start_loc, block_table, seq_lens, prompt_lens,
        stride_qt, stride_qh, stride_qd,
        stride_kp, stride_kt, stride_kh, stride_kd,
        stride_vp, stride_vt, stride_vh, stride_vd,
        stride_ot, stride_oh, stride_od,
        stride_bt, anchor, qk_scale,
        KV_GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        head = tl.program_id(0)
        req = tl.program_id(1)
        q_start = tl.load(query_start_loc + req)
        q_end = tl.load(query_start_loc + req + 1)
        seq_len = tl.load(seq_lens + req)
        tail = tl.maximum(tl.load(prompt_lens + req) - 1, 0)
        kv_head = head // KV_GROUP
        bt_row = block_table + req.to(tl.int64) * stride_bt
        # key blocks that can hold a visible key: the anchor's, then those from P - 1 on
        anchor_blocks = tl.cdiv(tl.minimum(anchor, seq_len), BLOCK_N)
        tail_first = tl.maximum(tail // BLOCK_N, anchor_blocks)
        tail_end = tl.cdiv(seq_len, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        for m0 in range(q_start, q_end, BLOCK_M):
            rows = m0 + offs_m
            row_ok = rows < q_end
            q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
            q = tl.load(Q + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh
                        + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
            q_pos = tl.load(query_positions + rows, mask=row_ok, other=0)
            # finite start value: padding rows end with l_i == 0 instead of NaN
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for kb in range(0, anchor_blocks):
                acc, l_i, m_i = _speed_key_block(
                    acc, l_i, m_i, q, q_pos, kb, K, V, bt_row, seq_len, anchor, tail, kv_head,
                    stride_kp, stride_kt, stride_kh, stride_kd,
                    stride_vp, stride_vt, stride_vh, stride_vd, qk_scale,
                    PAGE_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_F32)
            for kb in range(tail_first, tail_end):
                acc, l_i, m_i = _speed_key_block(
                    acc, l_i, m_i, q, q_pos, kb, K, V, bt_row, seq_len, anchor, tail, kv_head,
                    stride_kp, stride_kt, stride_kh, stride_kd,
                    stride_vp, stride_vt, stride_vh, stride_vd, qk_scale,
                    PAGE_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_F32)
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
            tl.store(O + rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh
                     + offs_d[None, :] * stride_od,
                     (acc / l_i[:, None]).to(O.dtype.element_ty), mask=q_mask)


@dataclass
class SpeedTritonPlan:
    """The step's metadata as device ``int32`` tensors for the Triton kernel: made once per
    step (:func:`plan_speed_upper_triton`), read by every upper layer
    (:func:`run_speed_upper_triton`)."""

    query_positions: torch.Tensor  # [T]
    query_start_loc: torch.Tensor  # [R + 1]
    block_table: torch.Tensor  # [R, max_pages]
    seq_lens: torch.Tensor  # [R]
    prompt_lens: torch.Tensor  # [R]
    anchor_tokens: int


def plan_speed_upper_triton(query_positions, query_start_loc, block_table, seq_lens,
                            prompt_lens, anchor_tokens: int,
                            device: torch.device) -> SpeedTritonPlan:
    def ints(values):
        return torch.as_tensor(values, dtype=torch.int32).to(device)

    return SpeedTritonPlan(ints(query_positions), ints(query_start_loc),
                           block_table.to(device=device, dtype=torch.int32), ints(seq_lens),
                           ints(prompt_lens), int(anchor_tokens))


def run_speed_upper_triton(plan: SpeedTritonPlan, query: torch.Tensor, key_pages, value_pages,
                           scale: float, block_m: int = 16, block_n: int = 32) -> torch.Tensor:
    """One layer's upper attention, Triton (strided ``[pages, page_size, H_kv, D]`` views;
    ``block_n`` keys per step, ``block_m`` query rows per tile, both powers of 2 >= 16)."""
    if not (isinstance(key_pages, torch.Tensor) and isinstance(value_pages, torch.Tensor)):
        raise TypeError("the Triton path needs strided K/V page views (packed CPU pages: torch)")
    out = torch.empty_like(query)
    num_reqs = plan.seq_lens.numel()
    if query.shape[0] == 0 or num_reqs == 0:
        return out
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, page_size = key_pages.shape[2], key_pages.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads}")
    table = plan.block_table
    _speed_upper_attention_kernel[(num_q_heads, num_reqs)](
        query, key_pages, value_pages, out,
        plan.query_positions, plan.query_start_loc, table, plan.seq_lens, plan.prompt_lens,
        *query.stride(), *key_pages.stride(), *value_pages.stride(), *out.stride(),
        table.stride(0), plan.anchor_tokens, scale * 1.4426950408889634,
        KV_GROUP=num_q_heads // num_kv_heads, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(next_power_of_2(head_dim), 16), HEAD_DIM=head_dim,
        DOT_F32=query.dtype == torch.float32 or triton_interpreter_enabled(),
    )
    return out


def _speed_upper_attention_triton(query, query_positions, query_start_loc, key_pages,
                                  value_pages, block_table, seq_lens, prompt_lens,
                                  anchor_tokens, scale, block_m=16, block_n=32):
    """Triton path of :func:`speed_upper_attention`: plan, then run."""
    plan = plan_speed_upper_triton(query_positions, query_start_loc, block_table, seq_lens,
                                   prompt_lens, anchor_tokens, query.device)
    return run_speed_upper_triton(plan, query, key_pages, value_pages, scale, block_m, block_n)


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
