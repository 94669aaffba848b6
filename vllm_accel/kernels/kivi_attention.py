"""Attention that reads the KIVI paged cache directly (decode and prefill with context).

Entry point: :func:`kivi_paged_attention` -- causal, varlen (vLLM's ``query_start_loc`` /
``seq_lens``), GQA.  The queries of sequence ``i`` are its last ``q_len_i`` positions; all keys
and values, including the ones written in this step, are read from the cache (vLLM calls
``do_kv_cache_update`` before attention), so attention sees exactly what
``kivi_format.fake_quant_kv`` models.

Two implementations behind one function:

* **torch reference** (CPU path): per sequence, dequantize its pages
  (:func:`kivi_cache.gather_sequence_kv`: codes -> fp32, tail rows for the unfinished key group)
  and run ``scaled_dot_product_attention`` in fp32 with a bottom-right causal mask.
* **Triton fused kernel**: flash attention whose inner loop loads *packed* tiles of BLOCK_N
  tokens and unpacks them in registers; dequantized K/V never go to memory.  Because BLOCK_N
  divides the key group, a key tile has one per-channel (scale, zero) row, and the scale is folded
  into the query instead of dequantizing every key element::

      q . (c * s + z) = (q * s) . c + q . z          (c: codes, exact in bf16)

  Values have one (scale, zero) per token when ``value_group == D``; then the scale is folded
  into the softmax weights: ``p @ (c*s + z) = (p*s) @ c + sum(p*z)``.  This removes one FMA per
  element on the bandwidth-critical decode path (``fold=False`` dequantizes element-wise, as
  does ``value_group < D``).  A program handles BLOCK_Q query tokens x the QPK query heads that
  share one KV head (BLOCK_M = BLOCK_Q * QPK rows, so a decode step with GQA still fills a
  tensor-core tile), for one KV head and one split of the key range.  A tile is either fully
  quantized (it ends before ``(seq_len // key_group) * key_group``) or fully in the tail, so a
  program runs two branch-free loops (quantized tiles, then at most ``key_group / BLOCK_N`` tail
  tiles), which keeps the main loop's loads pipelineable (``cp.async`` when compiled for sm_90);
  sink rows (offset < S in the page) are overlaid from their full-precision copy with masked
  loads.  The two products run in the query dtype (bf16/fp16 tensor cores) with fp32
  accumulation; fp32 queries, and the CPU interpreter (whose bf16 ``tl.dot`` is wrong in triton
  3.9), use fp32 products.  With several splits (flash-decoding: more programs for small decode
  batches) each split writes (acc, max, sum) and a small torch step merges them.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence

import torch

from vllm_accel.kernels._triton_utils import (
    HAS_TRITON,
    next_power_of_2,
    tl,
    triton,
    triton_interpreter_enabled,
)
from vllm_accel.kernels.kivi_cache import (
    _resolve_tail,
    _tl_dtype,
    gather_sequence_kv,
    resolve_backend,
)
from vllm_accel.kernels.kivi_cpu import decode_attention
from vllm_accel.kernels.kivi_format import KiviLayout, KiviViews, rotate_values
from vllm_accel.kernels.kivi_prefill_cpu import prefill_attention

if HAS_TRITON:
    from vllm_accel.kernels.kivi_cache import _unpack_tile

__all__ = ["kivi_paged_attention", "choose_num_splits"]

_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Torch reference
# ---------------------------------------------------------------------------------------------
def _own_rows(chunk_kv, min_rows, q0, q1):
    """This sequence's rows of the step's own K/V, when its chunk attends to them."""
    if chunk_kv is None or q1 - q0 < min_rows:
        return None
    return chunk_kv[0][q0:q1], chunk_kv[1][q0:q1]


def _exact_context(context_kv, own, i):
    """Sequence ``i``'s unquantized K/V of its last context positions, when it has them and
    its chunk attends to its own K/V."""
    if context_kv is None or own is None:
        return None
    return context_kv[i]


def _attention_torch(
    query, cache, block_table, seq_lens, qsl, scale, layout, k_tail, tail_index, out, skip=(),
    chunk_kv=None, chunk_kv_min_rows=2, context_kv=None,
):
    sl = seq_lens.tolist()
    starts = qsl.tolist()
    tails = tail_index.tolist() if tail_index is not None else [None] * len(sl)
    hq = query.shape[1]
    for i, L in enumerate(sl):
        q0, q1 = starts[i], starts[i + 1]
        lq = q1 - q0
        if lq <= 0 or i in skip:
            continue
        if L <= 0:
            out[q0:q1] = 0
            continue
        k, v = gather_sequence_kv(
            cache, block_table[i], L, layout, k_tail=k_tail, tail_entry=tails[i], backend="torch"
        )
        own = _own_rows(chunk_kv, chunk_kv_min_rows, q0, q1)
        if own is not None:
            k[L - lq:], v[L - lq:] = own[0].float(), own[1].float()
        exact = _exact_context(context_kv, own, i)
        if exact is not None and exact[0].shape[0]:
            e = exact[0].shape[0]
            k[L - lq - e:L - lq], v[L - lq - e:L - lq] = exact[0].float(), exact[1].float()
        q = query[q0:q1].float().transpose(0, 1).unsqueeze(0)  # [1, Hq, lq, D]
        kk = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        vv = v.transpose(0, 1).unsqueeze(0)
        mask = None
        if lq > 1:
            qpos = torch.arange(L - lq, L, device=query.device)[:, None]
            mask = torch.arange(L, device=query.device)[None, :] <= qpos
        o = torch.nn.functional.scaled_dot_product_attention(
            q, kk, vv, attn_mask=mask, scale=scale, enable_gqa=kk.shape[1] != hq
        )
        out[q0:q1] = o[0].transpose(0, 1).to(out.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Triton fused kernel
# ---------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _mm(a, b, DOT_F32: tl.constexpr, DT: tl.constexpr):
        """``a @ b`` with fp32 accumulation: operands in DT (tensor cores), or exact fp32."""
        if DOT_F32:
            r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            r = tl.dot(a.to(DT), b.to(DT))
        return r

    @triton.jit
    def _kivi_tile(
        acc,
        m_i,
        l_i,
        q,
        qf,
        qpos,
        L,
        t,
        seq,
        kvh,
        entry,
        kc_ptr,
        s_kc_b,
        s_kc_h,
        vc_ptr,
        s_vc_b,
        s_vc_h,
        ks_ptr,
        kz_ptr,
        s_ks_b,
        s_ks_h,
        vs_ptr,
        vz_ptr,
        s_vs_b,
        s_vs_h,
        sk_ptr,
        sv_ptr,
        s_sk_b,
        s_sk_h,
        tail_ptr,
        s_tail_e,
        s_tail_h,
        bt_ptr,
        s_bt,
        qk_scale,
        N: tl.constexpr,
        G: tl.constexpr,
        D: tl.constexpr,
        DP: tl.constexpr,
        BITS_K: tl.constexpr,
        BITS_V: tl.constexpr,
        VG: tl.constexpr,
        S: tl.constexpr,
        PAGE_RESIDUAL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_F32: tl.constexpr,
        DT: tl.constexpr,
        FOLD: tl.constexpr,
        QUANT_KEYS: tl.constexpr,
    ):
        """One BLOCK_N-token tile of the online softmax.  ``QUANT_KEYS``: the tile's keys are packed
        codes (a complete key group), else full-precision tail rows.  Branch-free inside."""
        RBK: tl.constexpr = D * BITS_K // 8
        RBV: tl.constexpr = D * BITS_V // 8
        NVG: tl.constexpr = D // VG
        d = tl.arange(0, DP)
        dmask = d < D
        n = tl.arange(0, BLOCK_N)
        start = t * BLOCK_N
        page = tl.load(bt_ptr + seq * s_bt + start // N).to(tl.int64)
        off0 = start % N
        rows = off0 + n
        # ---- scores
        if QUANT_KEYS:
            cbk = tl.arange(0, DP * BITS_K // 8)
            kb = tl.load(
                kc_ptr + page * s_kc_b + kvh * s_kc_h + rows[:, None] * RBK + cbk[None, :],
                mask=(cbk < RBK)[None, :],
                other=0,
            )
            kcodes = _unpack_tile(kb, BITS_K, BLOCK_N, DP)
            sp = page * s_ks_b + kvh * s_ks_h + (off0 // G) * D + d
            k_sc = tl.load(ks_ptr + sp, mask=dmask, other=0.0).to(tl.float32)
            k_ze = tl.load(kz_ptr + sp, mask=dmask, other=0.0).to(tl.float32)
            if FOLD:
                # q.(c*s + z) = (q*s).c + q.z: the tile's per-channel scale goes into q
                qk = _mm(qf * k_sc[None, :], tl.trans(kcodes), DOT_F32, DT)
                qk = qk + tl.sum(qf * k_ze[None, :], axis=1)[:, None]
            else:
                k_deq = kcodes.to(tl.float32) * k_sc[None, :] + k_ze[None, :]
                qk = _mm(q, tl.trans(k_deq), DOT_F32, DT)
        else:
            if PAGE_RESIDUAL:
                e = page
            else:
                e = entry
            k_tail = tl.load(
                tail_ptr + e * s_tail_e + kvh * s_tail_h + (rows % G)[:, None] * D + d[None, :],
                mask=dmask[None, :],
                other=0.0,
            )
            qk = _mm(q, tl.trans(k_tail), DOT_F32, DT)
        if S > 0:  # sink rows (offset < S): scores from the full-precision copy (masked load)
            smask = rows < S
            spp = page * s_sk_b + kvh * s_sk_h + rows[:, None] * D + d[None, :]
            k_s = tl.load(sk_ptr + spp, mask=smask[:, None] & dmask[None, :], other=0.0)
            qk = tl.where(smask[None, :], _mm(q, tl.trans(k_s), DOT_F32, DT), qk)
        # ---- online softmax (base 2)
        kpos = start + n
        ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < L)
        qk = tl.where(ok, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # ---- values: packed codes with per-token scale/zero
        p_code = p
        if S > 0:
            p_code = tl.where((rows < S)[None, :], 0.0, p)
        cbv = tl.arange(0, DP * BITS_V // 8)
        vb = tl.load(
            vc_ptr + page * s_vc_b + kvh * s_vc_h + rows[:, None] * RBV + cbv[None, :],
            mask=(cbv < RBV)[None, :],
            other=0,
        )
        vcodes = _unpack_tile(vb, BITS_V, BLOCK_N, DP)
        if FOLD and NVG == 1:
            # p.(c*s + z) = (p*s).c + sum(p*z): the per-token scale goes into p
            vp = page * s_vs_b + kvh * s_vs_h + rows
            v_sc = tl.load(vs_ptr + vp).to(tl.float32)
            v_ze = tl.load(vz_ptr + vp).to(tl.float32)
            pv = _mm(p_code * v_sc[None, :], vcodes, DOT_F32, DT)
            pv = pv + tl.sum(p_code * v_ze[None, :], axis=1)[:, None]
        else:
            vp = page * s_vs_b + kvh * s_vs_h + rows[:, None] * NVG + (d // VG)[None, :]
            v_deq = vcodes.to(tl.float32) * tl.load(vs_ptr + vp, mask=dmask[None, :], other=0.0).to(
                tl.float32
            ) + tl.load(vz_ptr + vp, mask=dmask[None, :], other=0.0).to(tl.float32)
            pv = _mm(p_code, v_deq, DOT_F32, DT)
        if S > 0:  # sink rows: values from the full-precision copy
            smask_v = rows < S
            spv = page * s_sk_b + kvh * s_sk_h + rows[:, None] * D + d[None, :]
            v_s = tl.load(sv_ptr + spv, mask=smask_v[:, None] & dmask[None, :], other=0.0)
            pv = pv + _mm(tl.where(smask_v[None, :], p, 0.0), v_s, DOT_F32, DT)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l_i

    @triton.jit
    def _kivi_attn_kernel(
        q_ptr,
        s_q_t,
        s_q_h,
        kc_ptr,
        s_kc_b,
        s_kc_h,
        vc_ptr,
        s_vc_b,
        s_vc_h,
        ks_ptr,
        kz_ptr,
        s_ks_b,
        s_ks_h,
        vs_ptr,
        vz_ptr,
        s_vs_b,
        s_vs_h,
        sk_ptr,
        sv_ptr,
        s_sk_b,
        s_sk_h,
        tail_ptr,
        s_tail_e,
        s_tail_h,
        bt_ptr,
        s_bt,
        seq_lens_ptr,
        qsl_ptr,
        tail_idx_ptr,
        o_ptr,
        s_o_t,
        s_o_h,
        pacc_ptr,
        pml_ptr,
        T,
        HQ,
        qk_scale,
        tiles_per_split,
        num_q_blocks,
        N: tl.constexpr,
        G: tl.constexpr,
        D: tl.constexpr,
        DP: tl.constexpr,
        BITS_K: tl.constexpr,
        BITS_V: tl.constexpr,
        VG: tl.constexpr,
        S: tl.constexpr,
        PAGE_RESIDUAL: tl.constexpr,
        QPK: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ONE_SPLIT: tl.constexpr,
        DOT_F32: tl.constexpr,
        DT: tl.constexpr,
        FOLD: tl.constexpr,
    ):
        """Program (sequence x query block, KV head, key split); see the module docstring."""
        pid0 = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq = pid0 // num_q_blocks
        qb = pid0 % num_q_blocks
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        L = tl.load(seq_lens_ptr + seq)
        if qb * BLOCK_Q < q_len:
            ctx = L - q_len
            r = tl.arange(0, BLOCK_M)
            qi = qb * BLOCK_Q + r // QPK
            hq = kvh * QPK + r % QPK
            row_ok = (r < BLOCK_Q * QPK) & (qi < q_len)
            qpos = ctx + qi
            tok = (q_start + qi).to(tl.int64)
            d = tl.arange(0, DP)
            dmask = d < D
            q = tl.load(
                q_ptr + tok[:, None] * s_q_t + hq[:, None] * s_q_h + d[None, :],
                mask=row_ok[:, None] & dmask[None, :],
                other=0.0,
            )
            qf = q.to(tl.float32)
            kv_end = tl.minimum(L, ctx + tl.minimum(q_len, (qb + 1) * BLOCK_Q))
            n_tiles = (kv_end + BLOCK_N - 1) // BLOCK_N
            t_lo = split * tiles_per_split
            t_hi = tl.minimum(n_tiles, t_lo + tiles_per_split)
            # tiles before t_mid hold complete (quantized) key groups, the rest read the tail
            t_mid = tl.minimum(t_hi, tl.maximum(t_lo, (L // G) * G // BLOCK_N))
            if PAGE_RESIDUAL:
                entry = 0
            else:
                entry = tl.load(tail_idx_ptr + seq).to(tl.int64)
            m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, DP), tl.float32)
            for t in range(t_lo, t_mid):
                acc, m_i, l_i = _kivi_tile(
                    acc,
                    m_i,
                    l_i,
                    q,
                    qf,
                    qpos,
                    L,
                    t,
                    seq,
                    kvh,
                    entry,
                    kc_ptr,
                    s_kc_b,
                    s_kc_h,
                    vc_ptr,
                    s_vc_b,
                    s_vc_h,
                    ks_ptr,
                    kz_ptr,
                    s_ks_b,
                    s_ks_h,
                    vs_ptr,
                    vz_ptr,
                    s_vs_b,
                    s_vs_h,
                    sk_ptr,
                    sv_ptr,
                    s_sk_b,
                    s_sk_h,
                    tail_ptr,
                    s_tail_e,
                    s_tail_h,
                    bt_ptr,
                    s_bt,
                    qk_scale,
                    N,
                    G,
                    D,
                    DP,
                    BITS_K,
                    BITS_V,
                    VG,
                    S,
                    PAGE_RESIDUAL,
                    BLOCK_N,
                    DOT_F32,
                    DT,
                    FOLD,
                    True,
                )
            for t in range(t_mid, t_hi):
                acc, m_i, l_i = _kivi_tile(
                    acc,
                    m_i,
                    l_i,
                    q,
                    qf,
                    qpos,
                    L,
                    t,
                    seq,
                    kvh,
                    entry,
                    kc_ptr,
                    s_kc_b,
                    s_kc_h,
                    vc_ptr,
                    s_vc_b,
                    s_vc_h,
                    ks_ptr,
                    kz_ptr,
                    s_ks_b,
                    s_ks_h,
                    vs_ptr,
                    vz_ptr,
                    s_vs_b,
                    s_vs_h,
                    sk_ptr,
                    sv_ptr,
                    s_sk_b,
                    s_sk_h,
                    tail_ptr,
                    s_tail_e,
                    s_tail_h,
                    bt_ptr,
                    s_bt,
                    qk_scale,
                    N,
                    G,
                    D,
                    DP,
                    BITS_K,
                    BITS_V,
                    VG,
                    S,
                    PAGE_RESIDUAL,
                    BLOCK_N,
                    DOT_F32,
                    DT,
                    FOLD,
                    False,
                )
            if ONE_SPLIT:
                o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
                tl.store(
                    o_ptr + tok[:, None] * s_o_t + hq[:, None] * s_o_h + d[None, :],
                    o.to(o_ptr.dtype.element_ty),
                    mask=row_ok[:, None] & dmask[None, :],
                )
            else:
                prow = (split * T + tok) * HQ + hq
                tl.store(pacc_ptr + prow[:, None] * DP + d[None, :], acc, mask=row_ok[:, None])
                tl.store(pml_ptr + prow * 2, m_i, mask=row_ok)
                tl.store(pml_ptr + prow * 2 + 1, l_i, mask=row_ok)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_programs: int, max_tiles: int, device: torch.device) -> int:
    """Key-range splits so that a decode batch keeps the GPU busy (about 4 programs per SM),
    with at least 8 tiles per split; 1 on CPU."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = -(-4 * sms // max(num_programs, 1))
    return max(1, min(want, max_tiles // 8))


def _attention_triton(
    query,
    views: KiviViews,
    tail,
    block_table,
    seq_lens,
    qsl,
    scale,
    layout: KiviLayout,
    tail_index,
    out,
    max_query_len,
    max_seq_len,
    num_splits,
    block_m,
    block_n,
    num_warps,
    num_stages,
    fold,
):
    t_n, hq, d = query.shape
    hkv = views.k_codes.shape[1]
    qpk = hq // hkv
    num_seqs = seq_lens.numel()
    if t_n == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((qsl[1:] - qsl[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if max_query_len <= 0 or max_seq_len <= 0:
        return out
    bm = max(16, next_power_of_2(qpk)) if max_query_len == 1 else max(block_m, next_power_of_2(qpk))
    if num_warps is None:
        num_warps = 4 if bm <= 16 else 8
    block_q = max(1, min(bm // qpk, max_query_len))
    if block_n is None:
        block_n = min(layout.key_group, 64)
    if block_n < 16 or layout.key_group % block_n != 0 or block_n & (block_n - 1):
        raise ValueError(
            f"kivi_paged_attention: invalid block_n={block_n}; allowed: a power of two >= 16 "
            f"dividing key_group={layout.key_group}"
        )
    num_q_blocks = -(-max_query_len // block_q)
    max_tiles = -(-max_seq_len // block_n)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs * num_q_blocks * hkv, max_tiles, query.device)
    num_splits = max(1, min(int(num_splits), max_tiles))
    tiles_per_split = -(-max_tiles // num_splits)
    num_splits = -(-max_tiles // tiles_per_split)
    dp = next_power_of_2(d)
    if num_splits > 1:
        pacc = torch.zeros(num_splits, t_n, hq, dp, dtype=torch.float32, device=query.device)
        pml = torch.zeros(num_splits, t_n, hq, 2, dtype=torch.float32, device=query.device)
        pml[..., 0] = float("-inf")
    else:
        pacc = pml = out  # unused
    sk = views.sink_k if layout.sink_tokens else views.v_scale
    sv = views.sink_v if layout.sink_tokens else views.v_scale
    page_mode = layout.residual == "page"
    tidx = qsl if (page_mode or tail_index is None) else tail_index.to(torch.int32).contiguous()
    grid = (num_seqs * num_q_blocks, hkv, num_splits)
    _kivi_attn_kernel[grid](
        query,
        query.stride(0),
        query.stride(1),
        views.k_codes,
        views.k_codes.stride(0),
        views.k_codes.stride(1),
        views.v_codes,
        views.v_codes.stride(0),
        views.v_codes.stride(1),
        views.k_scale,
        views.k_zero,
        views.k_scale.stride(0),
        views.k_scale.stride(1),
        views.v_scale,
        views.v_zero,
        views.v_scale.stride(0),
        views.v_scale.stride(1),
        sk,
        sv,
        sk.stride(0),
        sk.stride(1),
        tail,
        tail.stride(0),
        tail.stride(1),
        block_table,
        block_table.stride(0),
        seq_lens,
        qsl,
        tidx,
        out,
        out.stride(0),
        out.stride(1),
        pacc,
        pml,
        t_n,
        hq,
        scale * _LOG2E,
        tiles_per_split,
        num_q_blocks,
        N=layout.block_size,
        G=layout.key_group,
        D=d,
        DP=dp,
        BITS_K=layout.bits_k,
        BITS_V=layout.bits_v,
        VG=layout.value_group,
        S=layout.sink_tokens,
        PAGE_RESIDUAL=page_mode,
        QPK=qpk,
        BLOCK_Q=block_q,
        BLOCK_M=bm,
        BLOCK_N=block_n,
        ONE_SPLIT=num_splits == 1,
        DOT_F32=query.dtype == torch.float32 or triton_interpreter_enabled(),
        DT=_tl_dtype(query.dtype),
        FOLD=fold,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        m, lsum = pml[..., 0], pml[..., 1]
        m_max = m.amax(0)
        m_max = torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max)
        w = torch.exp2(m - m_max)
        l_tot = (lsum * w).sum(0)
        l_tot = torch.where(l_tot > 0, l_tot, torch.ones_like(l_tot))
        out.copy_(((pacc * w[..., None]).sum(0) / l_tot[..., None])[..., :d])
    return out


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------
def kivi_paged_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    layout: KiviLayout,
    *,
    k_tail: torch.Tensor | None = None,
    tail_index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_m: int = 64,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    fold: bool = True,
    backend: str = "auto",
    chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk_kv_min_rows: int = 2,
    context_kv: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> torch.Tensor:
    """Causal varlen GQA attention over the KIVI paged cache.

    Args:
        query: ``[T, Hq, D]``; the tokens of sequence ``i`` are rows
            ``query_start_loc[i]:query_start_loc[i+1]`` and sit at its last positions.
        cache: the layer's KIVI cache (``uint8 [num_blocks, H_kv, block_size, C]``).
        block_table: ``int [num_seqs, max_pages]`` page ids of each sequence.
        seq_lens: ``int [num_seqs]`` tokens in the cache per sequence (context + this step).
        query_start_loc: ``int [num_seqs + 1]``.
        scale: softmax scale.
        layout: the page format.
        k_tail / tail_index: residual="tail": the tail pool and ``int [num_seqs]`` entry holding
            each sequence's unfinished key group (ignored when ``seq_len % key_group == 0``).
        out: optional ``[T, Hq, D]`` output (written in place); default: new, query's dtype.
        max_query_len / max_seq_len: host ints if known (avoid a device sync; Triton only).
        num_splits: key-range splits (Triton); default from :func:`choose_num_splits`.
        block_m, block_n, num_warps, num_stages: Triton tile rows (prefill), tile tokens (a power
            of two dividing key_group; default min(key_group, 64)) and launch options (num_warps
            default: 4 for decode, 8 for prefill -- 4 spills registers at block_m=64 on sm_90).
        fold: Triton: fold the key scale into the query and (``value_group == D``) the value
            scale into the softmax weights instead of dequantizing every element (see above).
        backend: ``auto`` (Triton on CUDA; on CPU ``native`` when the extension is built,
            else ``torch``), ``torch``, ``triton`` or ``native`` (decode rows through
            :mod:`vllm_accel.kernels.kivi_cpu`, prefill rows through
            :mod:`vllm_accel.kernels.kivi_prefill_cpu`).
        chunk_kv: this step's unquantized ``(key, value)`` ``[T, H_kv, D]`` (rows aligned with
            ``query``). Sequences with at least ``chunk_kv_min_rows`` query rows (prefill
            chunks) attend to them for their own positions and to the cache for their context,
            as KIVI's reference does in prefill; the others (decode and draft-verification rows)
            read everything from the cache. CPU backends only.
        context_kv: per sequence, None or the unquantized ``(key, value)`` ``[e, H_kv, D]`` of
            the ``e`` context positions right before its chunk (earlier prefill steps of the
            same prompt, :mod:`vllm_accel.kv_quant.prompt_kv`): read instead of the cache's
            rows, for sequences that attend to ``chunk_kv``. CPU backends only.
    Returns ``out``.
    """
    t_n, hq, d = query.shape
    hkv = cache.shape[1]
    if d != layout.head_size:
        raise ValueError(
            f"kivi_paged_attention: query head_size={d} does not match "
            f"layout head_size={layout.head_size}"
        )
    if hq % hkv != 0:
        raise ValueError(
            f"kivi_paged_attention: num query heads {hq} is not a multiple of KV heads {hkv}"
        )
    if query_start_loc.numel() != seq_lens.numel() + 1:
        raise ValueError("kivi_paged_attention: query_start_loc must have num_seqs + 1 entries")
    views = layout.views(cache) if layout.residual == "page" or k_tail is None else None
    tail = _resolve_tail(layout, views, k_tail, hkv)
    if layout.residual == "tail" and tail_index is None:
        raise ValueError("kivi_paged_attention: residual='tail' needs tail_index [num_seqs]")
    if out is None:
        out = torch.zeros_like(query)
    backend = resolve_backend(backend, query.device, layout)
    if chunk_kv is not None and chunk_kv_min_rows < 2:
        raise ValueError("kivi_paged_attention: chunk_kv_min_rows must be >= 2 (decode rows "
                         "read their own key from the tail and their value from the cache)")
    if context_kv is not None and len(context_kv) != seq_lens.numel():
        raise ValueError("kivi_paged_attention: context_kv needs one entry per sequence")
    if max_query_len is not None and max_query_len < chunk_kv_min_rows:
        chunk_kv = context_kv = None  # no sequence's chunk reads them (decode-only steps)
    if layout.value_rotation != "none":  # the pages hold rotated values: rotate the others in
        if chunk_kv is not None:
            chunk_kv = (chunk_kv[0], rotate_values(chunk_kv[1], layout))
        if context_kv is not None:
            context_kv = [None if c is None else (c[0], rotate_values(c[1], layout))
                          for c in context_kv]
    if backend == "triton":
        if chunk_kv is not None or context_kv is not None:
            raise NotImplementedError("kivi_paged_attention: chunk_kv and context_kv are not "
                                      "supported by the Triton kernel yet")
        if query.stride(2) != 1 or out.stride(2) != 1:
            raise ValueError("kivi_paged_attention: query/out need a contiguous last dimension")
        _attention_triton(
            query,
            layout.views(cache) if views is None else views,
            tail,
            block_table,
            seq_lens.to(torch.int32).contiguous(),
            query_start_loc.to(torch.int32).contiguous(),
            scale,
            layout,
            tail_index,
            out,
            max_query_len,
            max_seq_len,
            num_splits,
            block_m,
            block_n,
            num_warps,
            num_stages,
            fold,
        )
    elif backend == "native":  # both paths return rows in the value space (rotated back)
        native_rows = _attention_native_decode(
            query, cache, block_table, seq_lens, query_start_loc, scale, layout, k_tail,
            tail_index, out, max_query_len
        )
        _attention_split_prefill(
            query, cache, block_table, seq_lens, query_start_loc, scale, layout, k_tail,
            tail_index, out, native_rows, chunk_kv, chunk_kv_min_rows, context_kv
        )
        return out
    else:
        _attention_torch(
            query, cache, block_table, seq_lens, query_start_loc, scale, layout, k_tail,
            tail_index, out, chunk_kv=chunk_kv, chunk_kv_min_rows=chunk_kv_min_rows,
            context_kv=context_kv
        )
    if layout.value_rotation != "none":  # computed over rotated values: rotate the output back
        out.copy_(rotate_values(out, layout))
    return out


def _attention_split_prefill(
    query, cache, block_table, seq_lens, qsl, scale, layout, k_tail, tail_index, out, skip,
    chunk_kv, chunk_kv_min_rows, context_kv
):
    """The rows not in ``skip`` (prefill chunks) through :mod:`kivi_prefill_cpu`, rotated back
    to the value space when the layout rotates values."""
    sl = seq_lens.tolist()
    starts = qsl.tolist()
    tails = tail_index.tolist() if tail_index is not None else [None] * len(sl)
    for i, L in enumerate(sl):
        q0, q1 = starts[i], starts[i + 1]
        if q1 <= q0 or i in skip:
            continue
        if L <= 0:
            out[q0:q1] = 0
            continue
        own = _own_rows(chunk_kv, chunk_kv_min_rows, q0, q1)
        got = prefill_attention(
            query[q0:q1], cache, block_table[i], L, scale, layout, k_tail=k_tail,
            tail_entry=tails[i], chunk_kv=own, context_kv=_exact_context(context_kv, own, i),
        )
        out[q0:q1] = rotate_values(got, layout).to(out.dtype)
    return out


def _attention_native_decode(
    query, cache, block_table, seq_lens, qsl, scale, layout, k_tail, tail_index, out,
    max_query_len
) -> Collection[int]:
    """Decode rows (one query token) through the native kernel; returns their sequences."""
    num_seqs = seq_lens.shape[0]
    if max_query_len == 1 and query.shape[0] == num_seqs:  # pure decode: one row per sequence
        out.copy_(decode_attention(query, cache, block_table, seq_lens, scale, layout,
                                   k_tail=k_tail, tail_index=tail_index))
        return range(num_seqs)
    starts = qsl.tolist()
    seqs = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1]
    if not seqs:
        return set()
    idx = torch.tensor(seqs, dtype=torch.int64)
    rows = qsl.to(torch.int64)[idx]
    got = decode_attention(
        query[rows], cache, block_table[idx], seq_lens[idx], scale, layout, k_tail=k_tail,
        tail_index=tail_index[idx] if tail_index is not None else None,
    )
    out[rows] = got.to(out.dtype)
    return set(seqs)
