"""KIVI cache on the CPU through the native ``vllm_accel._C_kivi``: decode attention that reads
packed pages directly, and quantize-on-write.

The torch reference (:func:`~vllm_accel.kernels.kivi_attention.kivi_paged_attention` with
``backend="torch"``) dequantizes a sequence's whole cache to fp32 and runs SDPA, every step:
a decode step then costs more than with the bf16 cache. The native kernel
(``csrc/kivi/kivi_decode.cpp``) folds the key-group channel scales into the query and the
per-token value scales into the softmax weights, unpacks each token's codes once for all query
heads of its KV head, and reads only the packed bytes (72 B per token and KV head for kivi_4bit
at D=64 instead of bf16's 256 B). Only decode rows (one query token) use it; prefill rows stay on
the torch path. :func:`write_tokens` writes the same bytes as the torch reference write (one
C++ pass instead of ~50 small torch ops per layer and step).

    >>> import torch
    >>> from vllm_accel.kernels.kivi_format import KiviLayout
    >>> from vllm_accel.kernels.kivi_cache import quantize_on_write
    >>> lay = KiviLayout(4, 4, head_size=64, block_size=128, key_group=64)
    >>> cache, tail = lay.allocate(2, 1), lay.allocate_tail(1, 1)
    >>> k, v = torch.randn(100, 1, 64), torch.randn(100, 1, 64)
    >>> quantize_on_write(k, v, cache, torch.arange(100), lay, k_tail=tail,
    ...                   tail_mapping=torch.zeros(100, dtype=torch.long))
    >>> q = torch.randn(1, 2, 64)
    >>> args = (q, cache, torch.tensor([[0, 1]]), torch.tensor([100]), 0.125, lay)
    >>> got = decode_attention(*args, k_tail=tail, tail_index=torch.tensor([0]))
    >>> from vllm_accel.kernels.kivi_attention import kivi_paged_attention
    >>> want = kivi_paged_attention(q, cache, torch.tensor([[0, 1]]), torch.tensor([100]),
    ...     torch.tensor([0, 1]), 0.125, lay, k_tail=tail, tail_index=torch.tensor([0]),
    ...     backend="torch")
    >>> bool(torch.allclose(got, want, atol=1e-4)) or not HAS_NATIVE
    True

No vLLM import.
"""

from __future__ import annotations

import functools

import torch

from vllm_accel.kernels.kivi_format import KiviLayout

try:  # built by setup.py (optional, like _C_sam)
    from vllm_accel import _C_kivi
except ImportError:  # pragma: no cover - depends on the build
    _C_kivi = None

HAS_NATIVE = _C_kivi is not None

__all__ = ["HAS_NATIVE", "native_problem", "decode_attention", "unfinished_group_rows",
           "write_tokens"]


def native_problem(layout: KiviLayout, device: torch.device) -> str | None:
    """Why the native kernel cannot run this layout (None when it can)."""
    if not HAS_NATIVE:
        return "the native extension vllm_accel._C_kivi is not built"
    if device.type != "cpu":
        return f"the native kernel runs on CPU tensors, not {device.type}"
    return None


def unfinished_group_rows(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          layout: KiviLayout, k_tail: torch.Tensor | None,
                          tail_index: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``[num_seqs, H_kv, key_group, D]``: the full-precision keys of each sequence's
    unfinished key group (rows past ``seq_len % key_group`` are unused)."""
    if layout.residual == "tail":
        if k_tail is None or tail_index is None:
            raise ValueError("KIVI: residual='tail' needs k_tail and tail_index")
        return k_tail[tail_index.to(torch.int64)].float()
    pages = (seq_lens.to(torch.int64) // layout.block_size).clamp(max=block_table.shape[1] - 1)
    blocks = block_table.to(torch.int64).gather(1, pages[:, None])[:, 0]
    return layout.views(cache).residual_k[blocks].float()


def decode_attention(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, layout: KiviLayout, *,
                     k_tail: torch.Tensor | None = None, tail_index: torch.Tensor | None = None,
                     num_threads: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence (its last position) over the KIVI cache.
    With ``layout.value_rotation`` the kernel rotates each output row back from the pages'
    rotated value space, so the result is in the model's value space either way.

    Args:
        query: ``[num_seqs, Hq, D]``.
        cache: ``uint8 [num_blocks, H_kv, block_size, C]``.
        block_table: ``int [num_seqs, max_pages]``; seq_lens: ``int [num_seqs]``.
        k_tail / tail_index: residual="tail" as in ``kivi_paged_attention``.
        num_threads: worker threads (default ``torch.get_num_threads()``).
    Returns fp32 ``[num_seqs, Hq, D]``.
    """
    problem = native_problem(layout, query.device)
    if problem is not None:
        raise RuntimeError(f"KIVI native decode: {problem}")
    pages = layout.page_view(cache)
    num_seqs, hq, d = query.shape
    hkv = pages.shape[1]
    if d != layout.head_size or hq % hkv != 0:
        raise ValueError(f"KIVI native decode: query {tuple(query.shape)} does not fit "
                         f"{hkv} KV heads of size {layout.head_size}")
    q = query.float().contiguous()
    bt = block_table.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    tail = unfinished_group_rows(cache, bt, sl, layout, k_tail, tail_index).contiguous()
    out = torch.empty((num_seqs, hq, d), dtype=torch.float32)
    _C_kivi.decode(pages.data_ptr(), bt.data_ptr(), bt.shape[1], sl.data_ptr(), num_seqs,
                   q.data_ptr(), tail.data_ptr(), out.data_ptr(),
                   _geometry(layout, pages, hq, scale), num_threads or torch.get_num_threads())
    return out


def _geometry(layout: KiviLayout, pages: torch.Tensor, num_q_heads: int, scale: float = 1.0):
    """The kernel's view of a layer: page regions and the cache's strides (in bytes)."""
    return _geometry_for(layout, pages.stride(0), pages.stride(1), pages.shape[1], num_q_heads,
                         float(scale))


@functools.lru_cache(maxsize=64)  # built once per layer shape, not in every call of every step
def _geometry_for(layout: KiviLayout, block_stride: int, head_stride: int, num_kv_heads: int,
                  num_q_heads: int, scale: float):
    regions = layout.regions
    geo = _C_kivi.Geometry()
    geo.block_stride, geo.head_stride = block_stride, head_stride
    geo.page_bytes, geo.num_kv_heads, geo.num_q_heads = layout.page_bytes, num_kv_heads, \
        num_q_heads
    geo.head_size, geo.block_size, geo.key_group = (layout.head_size, layout.block_size,
                                                    layout.key_group)
    geo.bits_k, geo.bits_v, geo.value_group = layout.bits_k, layout.bits_v, layout.value_group
    geo.off_kc, geo.off_vc = regions["k_codes"].offset, regions["v_codes"].offset
    geo.off_ks, geo.off_kz = regions["k_scale"].offset, regions["k_zero"].offset
    geo.off_vs, geo.off_vz = regions["v_scale"].offset, regions["v_zero"].offset
    if layout.sink_tokens:
        geo.sink_tokens = layout.sink_tokens
        geo.off_sk, geo.off_sv = regions["sink_k"].offset, regions["sink_v"].offset
        geo.sink_elem_bytes = layout.dtype.itemsize
        geo.sink_bf16 = layout.dtype == torch.bfloat16
    geo.scale = scale
    if layout.value_rotation != "none":  # decode rotates its output back (fused in the kernel)
        geo.rotate_out = layout.head_size ** -0.5
    return geo


def write_tokens(key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                 tail: torch.Tensor, slot: torch.Tensor, entry: torch.Tensor,
                 layout: KiviLayout, num_threads: int | None = None) -> None:
    """Quantize-on-write of ``[T, H_kv, D]`` keys/values into ``pages`` (the layer's
    ``[num_blocks, H_kv, page_bytes]`` view) and the residual rows ``tail`` (``[E, H_kv, G, D]``
    of the layout dtype: the tail pool or the pages' residual area), writing the bytes the
    torch reference writes. ``slot``/``entry``: int64 ``[T]`` (negative slots are skipped)."""
    problem = native_problem(layout, key.device)
    if problem is not None:
        raise RuntimeError(f"KIVI native write: {problem}")
    k = key.to(layout.dtype).contiguous()
    v = value.to(layout.dtype).contiguous()
    s = slot.to(torch.int64).contiguous()
    e = entry.to(torch.int64).contiguous()
    args = _C_kivi.WriteArgs()
    args.cache, args.key, args.value = pages.data_ptr(), k.data_ptr(), v.data_ptr()
    args.slots, args.entries, args.tail = s.data_ptr(), e.data_ptr(), tail.data_ptr()
    args.num_tokens = k.shape[0]
    args.tail_entry_stride = tail.stride(0) * tail.element_size()
    args.tail_head_stride = tail.stride(1) * tail.element_size()
    args.bf16 = layout.dtype == torch.bfloat16
    args.elem_bytes = k.element_size()
    _C_kivi.write(args, _geometry(layout, pages, 1), num_threads or torch.get_num_threads())
