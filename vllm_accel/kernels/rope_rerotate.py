"""Move RoPE-rotated keys to new positions (position-independent KV reuse).

RoPE rotates each frequency pair ``(x1, x2)`` of a key at position ``p`` by the angle
``p * theta_j``::

    R(p) [x1, x2] = [x1 cos(p theta_j) - x2 sin(p theta_j),
                     x2 cos(p theta_j) + x1 sin(p theta_j)]

Rotations of the same plane compose by adding angles, ``R(p + delta) = R(delta) R(p)``. A
document chunk cached with its keys already rotated at positions ``p = start + i`` can therefore
be reused at positions ``p + delta`` by rotating the stored keys once more, by ``delta``; that
gives exactly the keys RoPE would produce at the new positions (up to float rounding), and the
values need no change at all. A negative ``delta`` (the chunk moves to earlier positions) uses
``cos(-d) = cos(d)`` and ``sin(-d) = -sin(d)``, so the cache row of ``|delta|`` serves, with the
sign applied to the sine half; ``|delta|`` must be below the cache's ``max_position``.

Layouts follow vLLM's ``RotaryEmbedding``: ``cos_sin_cache`` is ``[max_position, rotary_dim]``,
the cosines of the ``rotary_dim // 2`` frequencies, then their sines. Only the first
``rotary_dim`` dims of a head are rotated (partial rotary); the rest pass through unchanged.
NeoX style pairs dim ``i`` with ``i + rotary_dim // 2``; GPT-J style pairs ``2i`` with ``2i + 1``.

:func:`rerotate_keys` is the entry point: a vectorised torch path, and a Triton kernel (CUDA, or
CPU under ``TRITON_INTERPRET=1``) with one program per block of (token, head) rows that loads
the two halves of each pair and the cos/sin row of ``|delta|`` of its token, rotates in float32
and stores in the output dtype. Both take any strides (e.g. the result of a gather from the
paged cache) and may work in place (``out=keys``). :func:`apply_rope` is plain RoPE application
(the math of vLLM's ``RotaryEmbedding.forward_native``, in float32), the reference of the tests;
:func:`rope_cos_sin_cache` builds a plain (unscaled) cache in vLLM's layout.

Example (dense reference check)::

    >>> import torch
    >>> from vllm_accel.kernels.rope_rerotate import (
    ...     apply_rope, rerotate_keys, rope_cos_sin_cache)
    >>> cache = rope_cos_sin_cache(rotary_dim=32, max_position=256)
    >>> k = torch.randn(10, 2, 32)  # pre-RoPE keys of a 10-token chunk
    >>> stored = apply_rope(k, torch.arange(10), cache)  # cached at positions 0..9
    >>> moved = rerotate_keys(stored, 100, cache)  # reused at positions 100..109
    >>> torch.allclose(moved, apply_rope(k, torch.arange(100, 110), cache), atol=1e-5)
    True
"""

from __future__ import annotations

import math
import operator

import torch

from vllm_accel.kernels._triton_utils import (
    HAS_TRITON,
    choose_backend,
    next_power_of_2,
    tl,
    triton,
)


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float = 10000.0,
                       dtype: torch.dtype = torch.float32,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Plain (unscaled) RoPE cache ``[max_position, rotary_dim]`` in vLLM's layout: the cosines
    of the angles ``p * base ** (-2j / rotary_dim)``, ``j < rotary_dim // 2``, then their sines.

    The angles are computed in float64 and rounded once to ``dtype``, so entries agree with
    vLLM's float32-computed cache up to the float32 rounding of the angles (which for large ``p``
    is the larger error of the two)."""
    _check_rotary_dim(rotary_dim, rotary_dim)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)


def _check_rotary_dim(rotary_dim: int, head_dim: int) -> None:
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even, positive and <= head dim {head_dim}; "
                         f"got {rotary_dim}")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            is_neox_style: bool) -> torch.Tensor:
    """Rotate the pairs of float32 ``x [..., rotary_dim]`` by ``cos``/``sin [..., rd // 2]``
    (broadcast against ``x``'s leading dims)."""
    half = x.shape[-1] // 2
    if is_neox_style:
        x1, x2 = x[..., :half], x[..., half:]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat([o1, o2], dim=-1)
    return torch.stack([o1, o2], dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               rotary_dim: int | None = None, is_neox_style: bool = True) -> torch.Tensor:
    """Plain RoPE: ``x [N, ..., D]`` rotated at ``positions [N]`` (first ``rotary_dim`` dims;
    the rest copied), computed in float32 and returned in ``x``'s dtype. Same math as vLLM's
    ``RotaryEmbedding.forward_native`` (which computes in the cache's dtype)."""
    rotary_dim = x.shape[-1] if rotary_dim is None else int(rotary_dim)
    _check_rotary_dim(rotary_dim, x.shape[-1])
    if cos_sin_cache.shape[-1] != rotary_dim:
        raise ValueError(f"cos_sin_cache has {cos_sin_cache.shape[-1]} columns, "
                         f"rotary_dim is {rotary_dim}")
    half = rotary_dim // 2
    cs = cos_sin_cache.to(x.device).index_select(0, positions.to(x.device).long()).float()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cs[:, :half].reshape(shape), cs[:, half:].reshape(shape)
    out = x.clone()
    out[..., :rotary_dim] = _rotate(x[..., :rotary_dim].float(), cos, sin, is_neox_style)
    return out


def _delta_tensor(delta: torch.Tensor | int, num_tokens: int, max_position: int,
                  device: torch.device) -> torch.Tensor:
    """``delta`` as int64 ``[num_tokens]`` on ``device``, with ``|delta| < max_position``."""
    if isinstance(delta, torch.Tensor):
        if delta.dtype.is_floating_point or delta.dtype.is_complex or delta.dtype == torch.bool:
            raise ValueError(f"delta must be an integer tensor, got {delta.dtype}")
        if delta.dim() == 0:
            delta = delta.reshape(1).expand(num_tokens)
        elif delta.shape != (num_tokens,):
            raise ValueError(f"delta has shape {tuple(delta.shape)}, expected [{num_tokens}]")
        delta = delta.to(device=device, dtype=torch.int64).contiguous()
        worst = int(delta.abs().max()) if num_tokens else 0  # one host sync
    else:
        if isinstance(delta, bool):
            raise ValueError("delta must be an int or an integer tensor, got a bool")
        try:
            delta = operator.index(delta)  # int, numpy integer, ...
        except TypeError:
            raise ValueError(f"delta must be an int or an integer tensor, got "
                             f"{type(delta).__name__}") from None
        worst = abs(delta)
        delta = torch.full((num_tokens,), delta, dtype=torch.int64, device=device)
    if worst >= max_position:
        raise ValueError(f"|delta| = {worst} is out of the cos/sin cache: it must be < "
                         f"max_position = {max_position}")
    return delta


def rerotate_keys(
    keys: torch.Tensor,  # [N, H, D] (or [N, D]), any strides; float32 / float16 / bfloat16
    delta: torch.Tensor | int,  # int, or integer tensor [N]: per-token shift (may be negative)
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim], vLLM layout (cos | sin)
    rotary_dim: int | None = None,  # default D; dims >= rotary_dim pass through unchanged
    is_neox_style: bool = True,  # NeoX pairs (i, i + rd/2); GPT-J pairs (2i, 2i + 1)
    out: torch.Tensor | None = None,  # same shape as keys; may be keys itself (in place)
    backend: str = "auto",
) -> torch.Tensor:
    """Rotate keys stored with RoPE at positions ``p`` so that they are the keys at
    ``p + delta``; returns ``out`` (a new contiguous tensor when ``out`` is None).

    The rotation runs in float32 and is cast to ``out``'s dtype. ``out`` must be ``keys`` itself
    or not overlap it. ``backend``: ``"auto"`` (Triton on CUDA, torch otherwise), ``"torch"`` or
    ``"triton"``. Raises ValueError for an unknown backend, a bad ``rotary_dim``, or
    ``|delta| >= max_position`` (a tensor ``delta`` is checked with one host sync).
    """
    impl = choose_backend(backend, keys)
    if keys.dim() not in (2, 3):
        raise ValueError(f"keys must be [N, H, D] or [N, D], got shape {tuple(keys.shape)}")
    head_dim = keys.shape[-1]
    rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
    _check_rotary_dim(rotary_dim, head_dim)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(f"cos_sin_cache must be [max_position, rotary_dim={rotary_dim}], got "
                         f"shape {tuple(cos_sin_cache.shape)}")
    if out is None:
        out = torch.empty(keys.shape, dtype=keys.dtype, device=keys.device)
    elif out.shape != keys.shape or out.device != keys.device:
        raise ValueError(f"out is {tuple(out.shape)} on {out.device}, keys are "
                         f"{tuple(keys.shape)} on {keys.device}")
    num_tokens = keys.shape[0]
    deltas = _delta_tensor(delta, num_tokens, cos_sin_cache.shape[0], keys.device)
    if keys.numel() == 0:
        return out
    cache = cos_sin_cache.to(keys.device)
    in_place = out.data_ptr() == keys.data_ptr() and out.stride() == keys.stride()
    k3 = keys if keys.dim() == 3 else keys.unsqueeze(1)
    o3 = out if out.dim() == 3 else out.unsqueeze(1)
    if impl == "triton":
        _rerotate_keys_triton(k3, deltas, cache, rotary_dim, is_neox_style, o3,
                              copy_pass=not in_place)
        return out
    half = rotary_dim // 2
    cs = cache.index_select(0, deltas.abs()).float()  # [N, rotary_dim]
    cos = cs[:, None, :half]
    sin = torch.where(deltas[:, None, None] < 0, -cs[:, None, half:], cs[:, None, half:])
    rotated = _rotate(k3[..., :rotary_dim].float(), cos, sin, is_neox_style)
    o3[..., :rotary_dim] = rotated  # k3 was fully read into ``rotated``: in place is safe
    if rotary_dim < head_dim and not in_place:
        o3[..., rotary_dim:] = k3[..., rotary_dim:]
    return out


if HAS_TRITON:

    @triton.jit
    def _rerotate_keys_kernel(
        K, O, DELTA, CACHE,  # noqa: E741
        num_rows, num_heads,
        stride_kt, stride_kh, stride_kd,
        stride_ot, stride_oh, stride_od,
        stride_cp, stride_cd,
        HALF: tl.constexpr, ROT_DIM: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
        IS_NEOX: tl.constexpr, COPY_PASS: tl.constexpr,
    ):
        """Rows ``r = token * num_heads + head`` of one block: rotate the pairs of each row by
        the angle of its token's ``delta``, copy the pass-through dims when ``COPY_PASS``."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < num_rows
        tok = rows // num_heads
        head = rows % num_heads
        d = tl.load(DELTA + tok, mask=row_ok, other=0)
        pos = tl.where(d < 0, -d, d)
        offs_j = tl.arange(0, BLOCK_HALF)
        j_ok = offs_j < HALF
        mask = row_ok[:, None] & j_ok[None, :]
        c_row = CACHE + pos[:, None] * stride_cp
        cos = tl.load(c_row + offs_j[None, :] * stride_cd, mask=mask, other=1.0).to(tl.float32)
        sin = tl.load(c_row + (HALF + offs_j[None, :]) * stride_cd, mask=mask,
                      other=0.0).to(tl.float32)
        sin = tl.where(d[:, None] < 0, -sin, sin)
        if IS_NEOX:
            i1 = offs_j
            i2 = offs_j + HALF
        else:
            i1 = 2 * offs_j
            i2 = 2 * offs_j + 1
        k_row = K + (tok * stride_kt + head * stride_kh)[:, None]
        o_row = O + (tok * stride_ot + head * stride_oh)[:, None]
        x1 = tl.load(k_row + i1[None, :] * stride_kd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(k_row + i2[None, :] * stride_kd, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        tl.store(o_row + i1[None, :] * stride_od, o1.to(O.dtype.element_ty), mask=mask)
        tl.store(o_row + i2[None, :] * stride_od, o2.to(O.dtype.element_ty), mask=mask)
        if COPY_PASS:
            offs_p = ROT_DIM + tl.arange(0, BLOCK_PASS)
            p_mask = row_ok[:, None] & (offs_p < HEAD_DIM)[None, :]
            x = tl.load(k_row + offs_p[None, :] * stride_kd, mask=p_mask, other=0.0)
            tl.store(o_row + offs_p[None, :] * stride_od, x.to(O.dtype.element_ty),
                     mask=p_mask)


def _rerotate_keys_triton(keys: torch.Tensor, deltas: torch.Tensor, cache: torch.Tensor,
                          rotary_dim: int, is_neox_style: bool, out: torch.Tensor,
                          copy_pass: bool, block_elems: int = 2048) -> None:
    """Triton launch of :func:`rerotate_keys` on ``[N, H, D]`` views (checked inputs);
    about ``block_elems`` pairs per program."""
    num_tokens, num_heads, head_dim = keys.shape
    half = rotary_dim // 2
    block_half = next_power_of_2(half)
    block_r = max(1, min(block_elems // block_half, next_power_of_2(num_tokens * num_heads)))
    num_rows = num_tokens * num_heads
    copy_pass = copy_pass and rotary_dim < head_dim
    grid = (math.ceil(num_rows / block_r),)
    _rerotate_keys_kernel[grid](
        keys, out, deltas, cache,
        num_rows, num_heads,
        *keys.stride(), *out.stride(), *cache.stride(),
        HALF=half, ROT_DIM=rotary_dim, HEAD_DIM=head_dim,
        BLOCK_R=block_r, BLOCK_HALF=block_half,
        BLOCK_PASS=next_power_of_2(max(head_dim - rotary_dim, 1)),
        IS_NEOX=is_neox_style, COPY_PASS=copy_pass,
    )
