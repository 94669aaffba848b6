"""Write path (quantize-on-write) and read path (dequantize) of the KIVI paged KV cache.

The byte layout is defined in :mod:`vllm_accel.kernels.kivi_format`.  Each operation has a
plain-torch reference (vectorized over tokens, runs anywhere) and a Triton implementation (CUDA,
or the CPU interpreter with ``TRITON_INTERPRET=1``); both write the same bytes.

Write algorithm (:func:`quantize_on_write`, called as vLLM's ``do_kv_cache_update``)
---------------------------------------------------------------------------------
Tokens ``t`` of many sequences arrive with ``slot_mapping[t] = page * block_size + offset``
(negative = padding, skipped); the tokens of one sequence are contiguous and in position order
(vLLM's varlen batch).  For every token:

1. **Key group completion** (first, reads the tail as it was before this call): if
   ``(offset + 1) % key_group == 0`` the token completes the key group ``g = offset // key_group``.
   The group's ``key_group`` rows are gathered -- row ``r`` from the token ``key_group - 1 - r``
   positions earlier in this batch when that token wrote the matching slot, otherwise from the
   token's tail entry -- and quantized per channel into the page (codes rows ``g*G ..``, scale and
   zero row ``g``).  Sink rows (offset < S of group 0) are left out of min/max.
2. **Values**: quantized per token (groups of ``value_group`` channels) into row ``offset``.
3. **Sinks**: rows with offset < S also get a full-precision copy of K and V.
4. **Tail**: the key is stored in full precision in row ``offset % key_group`` of its tail entry
   (``tail_mapping[t]``; with ``residual="page"`` the entry is the page's own residual area).
   When several tokens of one call hit the same (entry, row) -- a long prefill into a reused
   entry -- the last one in batch order wins.

Prefill (a whole group in one call) and decode (one token per call) therefore produce identical
page bytes: keys are rounded to the layout dtype before quantization in both cases.

Read path
---------
:func:`dequantize_pages` returns dequantized K/V of whole pages (sink rows from their copies);
:func:`gather_sequence_kv` assembles one sequence (page rows, plus the unfinished key group from the
tail).  The fused attention kernel that reads packed pages directly is in
:mod:`vllm_accel.kernels.kivi_attention`.
"""

from __future__ import annotations

import torch

# Triton is optional: without it every entry point uses the torch reference.
from vllm_accel.kernels._triton_utils import (
    HAS_TRITON,
    next_power_of_2,
    tl,
    triton,
    triton_interpreter_enabled,
)
from vllm_accel.kernels.kivi_format import (
    KiviLayout,
    KiviViews,
    dequantize_codes,
    pack_codes,
    quantize_groups,
    rotate_values,
    unpack_codes,
)

__all__ = [
    "HAS_TRITON",
    "quantize_on_write",
    "dequantize_pages",
    "gather_sequence_kv",
    "tail_entries",
    "resolve_backend",
]

_BACKENDS = ("auto", "torch", "triton", "native")


def resolve_backend(backend: str, device: torch.device, layout: KiviLayout | None = None) -> str:
    """``auto`` -> ``triton`` on CUDA when Triton is importable; on CPU ``native`` when the
    extension can run ``layout`` (given), else ``torch``.

    ``triton`` on a CPU tensor requires ``TRITON_INTERPRET=1`` (set before Triton is imported);
    an explicit ``native`` that cannot run raises.
    """
    from vllm_accel.kernels.kivi_cpu import native_problem

    if backend not in _BACKENDS:
        raise ValueError(f"KIVI: invalid backend={backend!r}; allowed: {_BACKENDS}")
    if backend == "auto":
        if HAS_TRITON and device.type == "cuda":
            return "triton"
        if layout is not None and native_problem(layout, device) is None:
            return "native"
        return "torch"
    if backend == "native":
        problem = native_problem(layout, device) if layout is not None else "no layout given"
        if problem is not None:
            raise RuntimeError(f"KIVI: backend='native' cannot run: {problem}")
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("KIVI: backend='triton' requested but triton is not importable")
        if device.type != "cuda" and not triton_interpreter_enabled():
            raise RuntimeError(
                "KIVI: backend='triton' on a CPU tensor needs TRITON_INTERPRET=1 "
                "(set before importing triton)"
            )
    return backend


def _tl_dtype(dt: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dt]


# ---------------------------------------------------------------------------------------------
# Argument checks shared by both backends
# ---------------------------------------------------------------------------------------------
def _resolve_tail(
    layout: KiviLayout,
    views: KiviViews,
    k_tail: torch.Tensor | None,
    num_kv_heads: int,
) -> torch.Tensor:
    """The tensor holding residual keys: ``k_tail`` (residual="tail") or the in-page area."""
    if layout.residual == "page":
        if k_tail is not None:
            raise ValueError(
                "KIVI: k_tail must be None with residual='page' (the residual is in the page)"
            )
        return views.residual_k
    if k_tail is None:
        raise ValueError(
            "KIVI: residual='tail' needs k_tail [num_entries, H_kv, key_group, head_size]"
        )
    want = (num_kv_heads, layout.key_group, layout.head_size)
    if k_tail.dim() != 4 or tuple(k_tail.shape[1:]) != want:
        raise ValueError(
            f"KIVI: invalid k_tail shape={tuple(k_tail.shape)}; allowed: [num_entries, *{want}]"
        )
    if k_tail.dtype != layout.dtype:
        raise ValueError(f"KIVI: invalid k_tail dtype={k_tail.dtype}; allowed: {layout.dtype}")
    if k_tail.stride(3) != 1 or k_tail.stride(2) != layout.head_size:
        raise ValueError(
            "KIVI: k_tail rows must be contiguous ([key_group, head_size] per entry and head)"
        )
    return k_tail


def _check_kv(
    key: torch.Tensor, value: torch.Tensor, layout: KiviLayout, num_kv_heads: int
) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"KIVI: key/value must both be [T, H_kv, D]; "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.shape[1] != num_kv_heads or key.shape[2] != layout.head_size:
        raise ValueError(
            f"KIVI: key shape {tuple(key.shape)} does not match cache heads={num_kv_heads}, "
            f"head_size={layout.head_size}"
        )


# ---------------------------------------------------------------------------------------------
# Torch reference: write
# ---------------------------------------------------------------------------------------------
def _last_writer_mask(target: torch.Tensor) -> torch.Tensor:
    """True for the last occurrence (in index order) of every value of ``target`` (1-D int64)."""
    n = target.numel()
    order = torch.argsort(target * n + torch.arange(n, device=target.device))
    st = target[order]
    last_sorted = torch.ones(n, dtype=torch.bool, device=target.device)
    last_sorted[:-1] = st[1:] != st[:-1]
    win = torch.empty_like(last_sorted)
    win[order] = last_sorted
    return win


def _write_torch(key, value, views: KiviViews, tail, slot, entry, layout: KiviLayout) -> None:
    n_blk, g_sz, s_n = layout.block_size, layout.key_group, layout.sink_tokens
    h, d = key.shape[1], key.shape[2]
    idx = (slot >= 0).nonzero().squeeze(1)
    if idx.numel() == 0:
        return
    kd = key.to(layout.dtype)
    vd = value.to(layout.dtype)
    page = torch.div(slot, n_blk, rounding_mode="floor")
    off = slot - page * n_blk

    # 1. key groups completed by this call, quantized per channel (tail read before step 4)
    comp = idx[((off[idx] + 1) % g_sz) == 0]
    if comp.numel():
        r = torch.arange(g_sz, device=slot.device)
        back = g_sz - 1 - r
        cand = comp[:, None] - back[None, :]
        cand_c = cand.clamp(min=0)
        from_in = (cand >= 0) & (slot[cand_c] == slot[comp][:, None] - back[None, :])
        rows_in = kd[cand_c].float()  # [nc, G, H, D]
        rows_tail = tail[entry[comp]].float().permute(0, 2, 1, 3)  # [nc, G, H, D]
        grp = torch.where(from_in[:, :, None, None], rows_in, rows_tail)
        g = off[comp] // g_sz
        excl = None
        if s_n:
            excl = ((g[:, None] == 0) & (r[None, :] < s_n))[:, :, None, None]
        codes, scale, zero = quantize_groups(grp, layout.bits_k, dim=1, exclude=excl)
        rows = (g * g_sz)[:, None] + r[None, :]
        pc = page[comp]
        views.k_codes[pc[:, None], :, rows] = pack_codes(codes, layout.bits_k)
        views.k_scale[pc, :, g] = scale[:, 0]
        views.k_zero[pc, :, g] = zero[:, 0]

    # 2. values, per token
    p_i, o_i = page[idx], off[idx]
    vg = layout.value_group
    vcodes, vscale, vzero = quantize_groups(
        vd[idx].float().reshape(-1, h, d // vg, vg), layout.bits_v, dim=-1
    )
    views.v_codes[p_i, :, o_i] = pack_codes(vcodes.reshape(-1, h, d), layout.bits_v)
    views.v_scale[p_i, :, o_i] = vscale[..., 0]
    views.v_zero[p_i, :, o_i] = vzero[..., 0]

    # 3. full-precision sink rows
    if s_n:
        m = idx[off[idx] < s_n]
        views.sink_k[page[m], :, off[m]] = kd[m]
        views.sink_v[page[m], :, off[m]] = vd[m]

    # 4. residual keys (the last writer of an (entry, row) wins)
    e_i = entry[idx]
    win = _last_writer_mask(e_i * g_sz + o_i % g_sz)
    w = idx[win]
    tail[entry[w], :, off[w] % g_sz] = kd[w]


# ---------------------------------------------------------------------------------------------
# Triton: write
# ---------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _unpack_tile(packed, BITS: tl.constexpr, ROWS: tl.constexpr, DP: tl.constexpr):
        """Bytes ``[ROWS, DP*BITS/8]`` -> int32 codes ``[ROWS, DP]`` (low channel in low bits)."""
        P: tl.constexpr = 8 // BITS
        if P == 1:
            codes = packed.to(tl.int32)
        else:
            shifts = tl.arange(0, P) * BITS
            c = (packed.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
            codes = tl.reshape(c, (ROWS, DP))
        return codes

    @triton.jit
    def _pack_tile(codes, BITS: tl.constexpr, ROWS: tl.constexpr, DP: tl.constexpr):
        """int32 codes ``[ROWS, DP]`` -> bytes ``[ROWS, DP*BITS/8]`` (as int32 values 0..255)."""
        P: tl.constexpr = 8 // BITS
        if P == 1:
            packed = codes
        else:
            shifts = tl.arange(0, P) * BITS
            c = tl.reshape(codes, (ROWS, DP // P, P))
            packed = tl.sum(c << shifts[None, None, :], axis=2)
        return packed

    @triton.jit
    def _round_to_dtype(x, IS_BF16: tl.constexpr, DTYPE: tl.constexpr):
        """Round fp32 ``x`` to ``DTYPE`` (nearest even) and return it as fp32.

        bf16 rounding is done on the bits: the CPU interpreter's fp32->bf16 cast truncates.
        """
        if IS_BF16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            y = b.to(tl.float32, bitcast=True)
        else:
            y = x.to(DTYPE).to(tl.float32)
        return y

    @triton.jit
    def _quant_params(lo, hi, BITS: tl.constexpr):
        """fp16-rounded (scale, zero) as fp32 tensors, from fp32 min/max (see kivi_format)."""
        qmax: tl.constexpr = (1 << BITS) - 1
        # IEEE division (div_rn): the GPU's default fp32 '/' is approximate, torch's is exact
        scale = tl.minimum(tl.math.div_rn(hi - lo, tl.full(lo.shape, qmax, tl.float32)), 65504.0)
        scale = scale.to(tl.float16).to(tl.float32)
        zero = tl.minimum(tl.maximum(lo, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
        return scale, zero

    @triton.jit
    def _quant_codes(x, scale, zero, BITS: tl.constexpr):
        qmax: tl.constexpr = (1 << BITS) - 1
        safe = tl.where(scale > 0, scale, 1.0)
        c = tl.floor(tl.math.div_rn(x - zero, safe) + 0.5)
        c = tl.minimum(tl.maximum(c, 0.0), qmax)
        return c.to(tl.int32)

    @triton.jit
    def _kivi_write_keys_kernel(
        key_ptr,
        s_key_t,
        s_key_h,
        slot_ptr,
        entry_ptr,
        tail_ptr,
        s_tail_e,
        s_tail_h,
        kc_ptr,
        s_kc_b,
        s_kc_h,
        ks_ptr,
        kz_ptr,
        s_ks_b,
        s_ks_h,
        N: tl.constexpr,
        G: tl.constexpr,
        D: tl.constexpr,
        DP: tl.constexpr,
        BITS: tl.constexpr,
        S: tl.constexpr,
        PAGE_RESIDUAL: tl.constexpr,
        DTYPE: tl.constexpr,
        IS_BF16: tl.constexpr,
    ):
        """One program per (token, KV head): quantize the key group this token completes, if any."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        off = slot % N
        if (slot >= 0) & ((off + 1) % G == 0):
            page = slot // N
            if PAGE_RESIDUAL:
                entry = page
            else:
                entry = tl.load(entry_ptr + t).to(tl.int64)
            r = tl.arange(0, G)
            d = tl.arange(0, DP)
            dmask = d < D
            back = G - 1 - r
            cand = t - back
            cand_c = tl.maximum(cand, 0)
            cslot = tl.load(slot_ptr + cand_c).to(tl.int64)
            from_in = (cand >= 0) & (cslot == slot - back)
            x_in = tl.load(
                key_ptr + cand_c.to(tl.int64)[:, None] * s_key_t + h * s_key_h + d[None, :],
                mask=from_in[:, None] & dmask[None, :],
                other=0.0,
            )
            x_in = _round_to_dtype(x_in.to(tl.float32), IS_BF16, DTYPE)
            x_tail = tl.load(
                tail_ptr + entry * s_tail_e + h * s_tail_h + r[:, None] * D + d[None, :],
                mask=(~from_in)[:, None] & dmask[None, :],
                other=0.0,
            ).to(tl.float32)
            x = tl.where(from_in[:, None], x_in, x_tail)
            g = off // G
            excl = (g == 0) & (r < S)
            lo = tl.min(tl.where(excl[:, None], float("inf"), x), axis=0)
            hi = tl.max(tl.where(excl[:, None], float("-inf"), x), axis=0)
            empty = lo == float("inf")
            lo = tl.where(empty, 0.0, lo)
            hi = tl.where(empty, 0.0, hi)
            scale, zero = _quant_params(lo, hi, BITS)
            codes = _quant_codes(x, scale[None, :], zero[None, :], BITS)
            packed = _pack_tile(codes, BITS, G, DP)
            RB: tl.constexpr = D * BITS // 8
            cb = tl.arange(0, DP * BITS // 8)
            tl.store(
                kc_ptr + page * s_kc_b + h * s_kc_h + (g * G + r)[:, None] * RB + cb[None, :],
                packed.to(tl.uint8),
                mask=(cb < RB)[None, :],
            )
            sbase = page * s_ks_b + h * s_ks_h + g * D + d
            tl.store(ks_ptr + sbase, scale.to(tl.float16), mask=dmask)
            tl.store(kz_ptr + sbase, zero.to(tl.float16), mask=dmask)

    @triton.jit
    def _kivi_write_tokens_kernel(
        key_ptr,
        value_ptr,
        s_key_t,
        s_key_h,
        s_val_t,
        s_val_h,
        slot_ptr,
        entry_ptr,
        win_ptr,
        tail_ptr,
        s_tail_e,
        s_tail_h,
        vc_ptr,
        s_vc_b,
        s_vc_h,
        vs_ptr,
        vz_ptr,
        s_vs_b,
        s_vs_h,
        sk_ptr,
        sv_ptr,
        s_sk_b,
        s_sk_h,
        N: tl.constexpr,
        G: tl.constexpr,
        D: tl.constexpr,
        DP: tl.constexpr,
        BITS: tl.constexpr,
        VG: tl.constexpr,
        S: tl.constexpr,
        PAGE_RESIDUAL: tl.constexpr,
        DTYPE: tl.constexpr,
        IS_BF16: tl.constexpr,
    ):
        """One program per (token, KV head): value codes, sink copies and the residual key row."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            page = slot // N
            off = slot % N
            d = tl.arange(0, DP)
            dmask = d < D
            kf = _round_to_dtype(
                tl.load(key_ptr + t * s_key_t + h * s_key_h + d, mask=dmask, other=0.0).to(
                    tl.float32
                ),
                IS_BF16,
                DTYPE,
            )
            vf = _round_to_dtype(
                tl.load(value_ptr + t * s_val_t + h * s_val_h + d, mask=dmask, other=0.0).to(
                    tl.float32
                ),
                IS_BF16,
                DTYPE,
            )
            k = kf.to(DTYPE)  # exact: already rounded
            v = vf.to(DTYPE)
            # values: one (scale, zero) per VG channels; groups unrolled (VG may not be 2^k)
            NVG: tl.constexpr = D // VG
            scale = tl.zeros((DP,), tl.float32)
            zero = tl.zeros((DP,), tl.float32)
            srow = page * s_vs_b + h * s_vs_h + off * NVG
            for gi in tl.static_range(NVG):
                m = (d >= gi * VG) & (d < (gi + 1) * VG)
                lo = tl.min(tl.where(m, vf, float("inf")), axis=0)
                hi = tl.max(tl.where(m, vf, float("-inf")), axis=0)
                sc, ze = _quant_params(lo, hi, BITS)
                scale = tl.where(m, sc, scale)
                zero = tl.where(m, ze, zero)
                tl.store(vs_ptr + srow + gi, sc.to(tl.float16))
                tl.store(vz_ptr + srow + gi, ze.to(tl.float16))
            codes = _quant_codes(vf, scale, zero, BITS)
            packed = _pack_tile(codes[None, :], BITS, 1, DP)
            RB: tl.constexpr = D * BITS // 8
            cb = tl.arange(0, DP * BITS // 8)
            tl.store(
                vc_ptr + page * s_vc_b + h * s_vc_h + off * RB + cb[None, :],
                packed.to(tl.uint8),
                mask=(cb < RB)[None, :],
            )
            if S > 0:
                if off < S:
                    sbase = page * s_sk_b + h * s_sk_h + off * D + d
                    tl.store(sk_ptr + sbase, k, mask=dmask)
                    tl.store(sv_ptr + sbase, v, mask=dmask)
            win = tl.load(win_ptr + t)
            if win != 0:
                if PAGE_RESIDUAL:
                    entry = page
                else:
                    entry = tl.load(entry_ptr + t).to(tl.int64)
                tl.store(
                    tail_ptr + entry * s_tail_e + h * s_tail_h + (off % G) * D + d, k, mask=dmask
                )


def _write_triton(key, value, views: KiviViews, tail, slot, entry, layout: KiviLayout) -> None:
    t_n, h, d = key.shape
    if t_n == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("KIVI triton write: key/value need a contiguous last dimension")
    g_sz = layout.key_group
    page_mode = layout.residual == "page"
    page = torch.div(slot, layout.block_size, rounding_mode="floor")
    e = page if page_mode else entry
    target = torch.where(
        slot >= 0,
        e * g_sz + (slot - page * layout.block_size) % g_sz,
        -1 - torch.arange(t_n, device=slot.device),
    )
    win = _last_writer_mask(target).to(torch.int8)
    slot_c = slot.contiguous()
    entry_arg = slot_c if page_mode else entry.contiguous()
    dp = next_power_of_2(d)
    dt = _tl_dtype(layout.dtype)
    grid = (t_n, h)
    _kivi_write_keys_kernel[grid](
        key,
        key.stride(0),
        key.stride(1),
        slot_c,
        entry_arg,
        tail,
        tail.stride(0),
        tail.stride(1),
        views.k_codes,
        views.k_codes.stride(0),
        views.k_codes.stride(1),
        views.k_scale,
        views.k_zero,
        views.k_scale.stride(0),
        views.k_scale.stride(1),
        N=layout.block_size,
        G=g_sz,
        D=d,
        DP=dp,
        BITS=layout.bits_k,
        S=layout.sink_tokens,
        PAGE_RESIDUAL=page_mode,
        DTYPE=dt,
        IS_BF16=layout.dtype == torch.bfloat16,
    )
    sk = views.sink_k if layout.sink_tokens else views.v_scale
    sv = views.sink_v if layout.sink_tokens else views.v_scale
    _kivi_write_tokens_kernel[grid](
        key,
        value,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        slot_c,
        entry_arg,
        win,
        tail,
        tail.stride(0),
        tail.stride(1),
        views.v_codes,
        views.v_codes.stride(0),
        views.v_codes.stride(1),
        views.v_scale,
        views.v_zero,
        views.v_scale.stride(0),
        views.v_scale.stride(1),
        sk,
        sv,
        sk.stride(0),
        sk.stride(1),
        N=layout.block_size,
        G=g_sz,
        D=d,
        DP=dp,
        BITS=layout.bits_v,
        VG=layout.value_group,
        S=layout.sink_tokens,
        PAGE_RESIDUAL=page_mode,
        DTYPE=dt,
        IS_BF16=layout.dtype == torch.bfloat16,
    )


# ---------------------------------------------------------------------------------------------
# Public write entry point
# ---------------------------------------------------------------------------------------------
def quantize_on_write(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KiviLayout,
    *,
    k_tail: torch.Tensor | None = None,
    tail_mapping: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Write new tokens into the KIVI cache (vLLM's ``do_kv_cache_update``).

    Args:
        key, value: ``[T, H_kv, D]`` (any float dtype; rounded to ``layout.dtype`` first;
            values rotated first when ``layout.value_rotation`` says so).
        cache: the layer's ``uint8 [num_blocks, H_kv, block_size, C]`` (or ``[num_blocks, H_kv,
            page_bytes]``), C = ``layout.bytes_per_token_head``; modified in place.
        slot_mapping: ``[T]`` ints, ``page * block_size + offset``; negative entries are skipped.
        layout: the page format.
        k_tail: residual="tail" only: ``layout.dtype [num_entries, H_kv, key_group, D]``.
        tail_mapping: residual="tail" only: ``[T]`` tail entry of each token's key group (all
            tokens of a group share one entry; see kivi_format for the contract).
        backend: ``auto`` (Triton on CUDA; on CPU ``native`` when ``vllm_accel._C_kivi`` is
            built, else torch), ``torch``, ``triton`` or ``native``.
    """
    pages = layout.page_view(cache)  # validates the cache; the typed views cost ~80 us per
    h = pages.shape[1]  # call, so only the torch/Triton writers and the page residual build them
    _check_kv(key, value, layout, h)
    views = layout.views(pages) if layout.residual == "page" else None
    tail = _resolve_tail(layout, views, k_tail, h)
    slot = slot_mapping.to(torch.int64).reshape(-1)
    if slot.numel() != key.shape[0]:
        raise ValueError(f"KIVI: slot_mapping has {slot.numel()} entries for {key.shape[0]} tokens")
    if layout.residual == "tail":
        if tail_mapping is None:
            raise ValueError("KIVI: residual='tail' needs tail_mapping [T] (tail entry per token)")
        entry = tail_mapping.to(torch.int64).reshape(-1)
        if entry.numel() != slot.numel():
            raise ValueError(
                f"KIVI: tail_mapping has {entry.numel()} entries for {slot.numel()} tokens"
            )
    else:
        if tail_mapping is not None:
            raise ValueError("KIVI: tail_mapping must be None with residual='page'")
        entry = torch.div(slot, layout.block_size, rounding_mode="floor")
    if layout.value_rotation != "none":  # the page stores the rotated rows, rounded to dtype
        value = rotate_values(value.to(layout.dtype), layout)
    resolved = resolve_backend(backend, key.device, layout)
    if resolved == "native":
        from vllm_accel.kernels.kivi_cpu import write_tokens

        write_tokens(key, value, pages, tail, slot, entry, layout)
        return
    if views is None:
        views = layout.views(pages)
    if resolved == "triton":
        _write_triton(key, value, views, tail, slot, entry, layout)
    else:
        _write_torch(key, value, views, tail, slot, entry, layout)


def tail_entries(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    key_group: int,
    *,
    request_slots: torch.Tensor | None = None,
    entries_per_slot: int = 2,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tail entries of a pool with ``E = entries_per_slot`` entries per request slot: the key
    group ``g`` of the request in slot ``s`` uses entry ``E*s + g % E``.

    ``E = 1`` is enough when a sequence only grows; ``E = 2`` keeps the previous group's rows
    intact when speculative decoding rolls back across a group boundary (the rejected drafts
    completed the group and started the next one in the other entry).

    Args:
        query_start_loc: ``[num_seqs + 1]`` token ranges of this step's sequences.
        seq_lens: ``[num_seqs]`` tokens in the cache per sequence after this step.
        key_group: the layout's key group.
        request_slots: ``[num_seqs]`` stable slot of each request in the tail pool (default: the
            batch row; only valid if rows do not move between steps).
        entries_per_slot: E (1 or 2).
        num_tokens: T (avoids a device sync; default ``query_start_loc[-1]``).
    Returns:
        ``tail_mapping [T]`` for :func:`quantize_on_write` and ``tail_index [num_seqs]`` for
        attention (the entry of the unfinished group ``seq_len // key_group``; unused when
        ``seq_len`` is a multiple of ``key_group``).
    """
    if entries_per_slot not in (1, 2):
        raise ValueError(f"KIVI: entries_per_slot must be 1 or 2, got {entries_per_slot}")
    dev = seq_lens.device
    qsl = query_start_loc.to(torch.int64)
    num_seqs = seq_lens.numel()
    slots = (
        torch.arange(num_seqs, device=dev)
        if request_slots is None
        else request_slots.to(device=dev, dtype=torch.int64)
    )
    q_lens = qsl[1:] - qsl[:-1]
    t_n = int(qsl[-1]) if num_tokens is None else num_tokens
    seq_of_tok = torch.repeat_interleave(
        torch.arange(num_seqs, device=dev), q_lens, output_size=t_n
    )
    sl = seq_lens.to(torch.int64)
    pos = sl[seq_of_tok] - q_lens[seq_of_tok] + torch.arange(t_n, device=dev) - qsl[seq_of_tok]
    e = entries_per_slot
    tail_mapping = e * slots[seq_of_tok] + (pos // key_group) % e
    tail_index = e * slots + (sl // key_group) % e
    return tail_mapping, tail_index


# ---------------------------------------------------------------------------------------------
# Read path: dequantize whole pages
# ---------------------------------------------------------------------------------------------
def _dequantize_pages_torch(views: KiviViews, pages: torch.Tensor, layout: KiviLayout):
    g_sz = layout.key_group
    kc = unpack_codes(views.k_codes[pages], layout.bits_k)  # [P, H, N, D]
    ks = views.k_scale[pages].repeat_interleave(g_sz, dim=2)  # [P, H, N, D]
    kz = views.k_zero[pages].repeat_interleave(g_sz, dim=2)
    k = dequantize_codes(kc, ks, kz)
    vc = unpack_codes(views.v_codes[pages], layout.bits_v)
    vs = views.v_scale[pages].repeat_interleave(layout.value_group, dim=3)
    vz = views.v_zero[pages].repeat_interleave(layout.value_group, dim=3)
    v = dequantize_codes(vc, vs, vz)
    if layout.sink_tokens:
        s_n = layout.sink_tokens
        k[:, :, :s_n] = views.sink_k[pages].float()
        v[:, :, :s_n] = views.sink_v[pages].float()
    return k, v


if HAS_TRITON:

    @triton.jit
    def _kivi_dequant_kernel(
        kc_ptr,
        vc_ptr,
        s_kc_b,
        s_kc_h,
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
        pages_ptr,
        k_out,
        v_out,
        s_o_p,
        s_o_h,
        N: tl.constexpr,
        G: tl.constexpr,
        D: tl.constexpr,
        DP: tl.constexpr,
        BITS_K: tl.constexpr,
        BITS_V: tl.constexpr,
        VG: tl.constexpr,
        S: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One program per (page in the list, KV head, BLOCK_N-row tile): dequantize to fp32."""
        i = tl.program_id(0)
        h = tl.program_id(1)
        tile = tl.program_id(2)
        page = tl.load(pages_ptr + i).to(tl.int64)
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        d = tl.arange(0, DP)
        dmask = d < D
        RBK: tl.constexpr = D * BITS_K // 8
        RBV: tl.constexpr = D * BITS_V // 8
        cbk = tl.arange(0, DP * BITS_K // 8)
        cbv = tl.arange(0, DP * BITS_V // 8)
        kb = tl.load(
            kc_ptr + page * s_kc_b + h * s_kc_h + rows[:, None] * RBK + cbk[None, :],
            mask=(cbk < RBK)[None, :],
            other=0,
        )
        kcodes = _unpack_tile(kb, BITS_K, BLOCK_N, DP).to(tl.float32)
        srow = page * s_ks_b + h * s_ks_h + (rows // G)[:, None] * D + d[None, :]
        k = kcodes * tl.load(ks_ptr + srow, mask=dmask[None, :], other=0.0).to(
            tl.float32
        ) + tl.load(kz_ptr + srow, mask=dmask[None, :], other=0.0).to(tl.float32)
        vb = tl.load(
            vc_ptr + page * s_vc_b + h * s_vc_h + rows[:, None] * RBV + cbv[None, :],
            mask=(cbv < RBV)[None, :],
            other=0,
        )
        vcodes = _unpack_tile(vb, BITS_V, BLOCK_N, DP).to(tl.float32)
        NVG: tl.constexpr = D // VG
        vrow = page * s_vs_b + h * s_vs_h + rows[:, None] * NVG + (d // VG)[None, :]
        v = vcodes * tl.load(vs_ptr + vrow, mask=dmask[None, :], other=0.0).to(
            tl.float32
        ) + tl.load(vz_ptr + vrow, mask=dmask[None, :], other=0.0).to(tl.float32)
        if S > 0:
            smask = rows < S
            sp = page * s_sk_b + h * s_sk_h + rows[:, None] * D + d[None, :]
            m2 = smask[:, None] & dmask[None, :]
            k = tl.where(smask[:, None], tl.load(sk_ptr + sp, mask=m2, other=0.0).to(tl.float32), k)
            v = tl.where(smask[:, None], tl.load(sv_ptr + sp, mask=m2, other=0.0).to(tl.float32), v)
        optr = i * s_o_p + h * s_o_h + rows[:, None] * D + d[None, :]
        tl.store(k_out + optr, k, mask=dmask[None, :])
        tl.store(v_out + optr, v, mask=dmask[None, :])


def _dequantize_pages_triton(views: KiviViews, pages: torch.Tensor, layout: KiviLayout):
    p_n, h = pages.numel(), views.k_codes.shape[1]
    n_blk, d = layout.block_size, layout.head_size
    k = torch.empty(p_n, h, n_blk, d, dtype=torch.float32, device=pages.device)
    v = torch.empty_like(k)
    if p_n == 0:
        return k, v
    block_n = min(n_blk, layout.key_group)
    sk = views.sink_k if layout.sink_tokens else views.v_scale
    sv = views.sink_v if layout.sink_tokens else views.v_scale
    _kivi_dequant_kernel[(p_n, h, n_blk // block_n)](
        views.k_codes,
        views.v_codes,
        views.k_codes.stride(0),
        views.k_codes.stride(1),
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
        pages.contiguous(),
        k,
        v,
        k.stride(0),
        k.stride(1),
        N=n_blk,
        G=layout.key_group,
        D=d,
        DP=next_power_of_2(d),
        BITS_K=layout.bits_k,
        BITS_V=layout.bits_v,
        VG=layout.value_group,
        S=layout.sink_tokens,
        BLOCK_N=block_n,
    )
    return k, v


def dequantize_pages(
    cache: torch.Tensor, pages: torch.Tensor, layout: KiviLayout, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize whole pages: returns fp32 ``K, V [P, H_kv, block_size, D]`` for ``pages [P]``.
    ``V`` is in the page's value space: with ``layout.value_rotation`` the values are rotated
    (``rotate_values`` maps them back).

    Every row is decoded from its codes (sink rows from their full-precision copies), including
    rows of a key group that is not complete yet -- those keys live in the tail; use
    :func:`gather_sequence_kv` to assemble a sequence.
    """
    views = layout.views(cache)
    pages = pages.to(torch.int64).reshape(-1)
    if resolve_backend(backend, cache.device) == "triton":
        return _dequantize_pages_triton(views, pages, layout)
    return _dequantize_pages_torch(views, pages, layout)


def gather_sequence_kv(
    cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    layout: KiviLayout,
    *,
    k_tail: torch.Tensor | None = None,
    tail_entry: int | None = None,
    backend: str = "auto",
    length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[length, H_kv, D]`` (fp32) of the first ``length`` positions (default: all
    ``seq_len``) of one sequence of ``seq_len`` cached tokens, exactly as attention sees them
    (values in the page's space, rotated with ``layout.value_rotation``).

    Keys of complete groups are dequantized from the pages; keys of the unfinished last group
    (``seq_len % key_group`` tokens) come from the tail entry ``tail_entry`` (residual="tail") or
    from the last page's residual area (residual="page"). Only the pages holding the first
    ``length`` positions are dequantized.
    """
    n_blk, g_sz = layout.block_size, layout.key_group
    length = seq_len if length is None else length
    if not 0 <= length <= seq_len:
        raise ValueError(f"KIVI: length={length} must be in [0, seq_len={seq_len}]")
    n_pages = -(-length // n_blk)
    pages = block_table_row[:n_pages].to(torch.int64)
    k, v = dequantize_pages(cache, pages, layout, backend=backend)
    h, d = k.shape[1], k.shape[3]
    k = k.permute(0, 2, 1, 3).reshape(n_pages * n_blk, h, d)[:length]
    v = v.permute(0, 2, 1, 3).reshape(n_pages * n_blk, h, d)[:length]
    lq = (seq_len // g_sz) * g_sz
    rem = length - lq
    if rem > 0:
        views = layout.views(cache)
        if layout.residual == "page":
            tail_rows = views.residual_k[block_table_row[seq_len // n_blk].to(torch.int64), :,
                                         :rem]
        else:
            if k_tail is None or tail_entry is None:
                raise ValueError(
                    "KIVI: gather_sequence_kv needs k_tail and tail_entry "
                    "for an unfinished key group"
                )
            tail_rows = k_tail[int(tail_entry), :, :rem]
        k = k.clone()
        # (sink rows inside the unfinished group hold the same rounded key in both places)
        k[lq:] = tail_rows.float().transpose(0, 1)
    return k, v
