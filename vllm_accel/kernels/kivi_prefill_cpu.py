"""Prefill rows over the KIVI cache on the CPU: two flash-attention calls merged by their
log-sum-exp instead of one masked SDPA over the whole sequence.

The torch reference (:func:`~vllm_accel.kernels.kivi_attention.kivi_paged_attention` with
``backend="torch"``) dequantizes a sequence to fp32 and runs SDPA with an explicit
bottom-right causal mask: torch's CPU SDPA then materialises ``[Hq, q_len, seq_len]`` scores
in fp32 (about 1 GB per layer for a 4K chunk over 8K tokens of a 14-head model). A prefill
chunk's keys split into two parts that need no mask of their own:

* the **context** (positions before the chunk): every query sees all of it, so the queries of
  the ``Hq / H_kv`` heads that share a KV head are stacked into one sequence and attend without
  a mask (no GQA copy of the context);
* the **chunk itself**: square and causal (``is_causal=True`` is bottom-right aligned when the
  query and key lengths are equal); its keys and values are repeated per query head.

torch's CPU flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``) returns each
part's output and log-sum-exp, and the parts are merged exactly::

    out = (o_ctx * exp(lse_ctx - m) + o_chunk * exp(lse_chunk - m)) / (exp(lse_ctx - m) +
          exp(lse_chunk - m)),      m = max(lse_ctx, lse_chunk)

Both calls run in the query's dtype (bf16 models: bf16 operands, fp32 accumulation, as vLLM's
own CPU attention does). ``chunk_kv`` optionally gives the chunk's own keys and values (the
step's unquantized K/V) instead of the cache's: see ``kv_quant.prefill_kv``.

    >>> import torch
    >>> from vllm_accel.kernels.kivi_format import KiviLayout
    >>> from vllm_accel.kernels.kivi_cache import quantize_on_write
    >>> from vllm_accel.kernels.kivi_attention import kivi_paged_attention
    >>> lay = KiviLayout(4, 4, head_size=64, block_size=128, key_group=64)
    >>> cache, tail = lay.allocate(2, 1), lay.allocate_tail(1, 1)
    >>> k, v = torch.randn(200, 1, 64), torch.randn(200, 1, 64)
    >>> quantize_on_write(k, v, cache, torch.arange(200), lay, k_tail=tail,
    ...                   tail_mapping=torch.zeros(200, dtype=torch.long))
    >>> q = torch.randn(50, 2, 64)  # the last 50 positions: 150 of context
    >>> args = (q, cache, torch.tensor([[0, 1]]), torch.tensor([200]), torch.tensor([0, 50]),
    ...         0.125, lay)
    >>> got = kivi_paged_attention(*args, k_tail=tail, tail_index=torch.tensor([0]),
    ...                            backend="native")
    >>> want = kivi_paged_attention(*args, k_tail=tail, tail_index=torch.tensor([0]),
    ...                             backend="torch")
    >>> bool(torch.allclose(got, want, atol=1e-5))
    True

No vLLM import.
"""

from __future__ import annotations

import torch

from vllm_accel.kernels.kivi_cache import gather_sequence_kv
from vllm_accel.kernels.kivi_format import KiviLayout

__all__ = ["prefill_attention", "merge_attention_parts"]

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """``[1, H, Lq, D]`` inputs -> output ``[1, H, Lq, D]`` and fp32 log-sum-exp ``[1, H, Lq]``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)


def merge_attention_parts(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                          lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the union of two disjoint key sets, from each set's output
    ``[..., Lq, D]`` and log-sum-exp ``[..., Lq]``; fp32."""
    m = torch.maximum(lse_a, lse_b)
    w_a = (lse_a - m).exp_().unsqueeze(-1)
    w_b = (lse_b - m).exp_().unsqueeze(-1)
    return (o_a.float() * w_a + o_b.float() * w_b) / (w_a + w_b)


def _context_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Queries ``[Hq, lq, D]`` over context K/V ``[H_kv, ctx, D]`` (no mask): the query heads
    of one KV head are stacked along the sequence, so the context is not copied per head."""
    hq, lq, d = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    o, lse = _flash(q.reshape(1, hkv, group * lq, d), k.unsqueeze(0), v.unsqueeze(0), False,
                    scale)
    return o.reshape(hq, lq, d), lse.reshape(hq, lq)


def _chunk_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Queries ``[Hq, lq, D]`` over the chunk's own K/V ``[H_kv, lq, D]`` (causal)."""
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    o, lse = _flash(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), True, scale)
    return o[0], lse[0]


def prefill_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    scale: float,
    layout: KiviLayout,
    *,
    k_tail: torch.Tensor | None = None,
    tail_entry: int | None = None,
    chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    context_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's last ``q_len`` positions over its KIVI cache.

    Args:
        query: ``[q_len, Hq, D]`` (CPU), the queries of positions ``seq_len - q_len ..``.
        cache, block_table_row, seq_len, layout, k_tail, tail_entry: as
            :func:`~vllm_accel.kernels.kivi_cache.gather_sequence_kv`.
        chunk_kv: the chunk's own ``(key, value)`` ``[q_len, H_kv, D]`` to attend to instead of
            the cache's (dequantized) rows of those positions.
        context_kv: with ``chunk_kv``, the unquantized ``(key, value)`` ``[e, H_kv, D]`` of the
            last ``e`` context positions, read instead of the cache's; the rest of the context
            comes from the cache.
    Returns ``[q_len, Hq, D]`` in fp32.
    """
    lq, hq, d = query.shape
    ctx = seq_len - lq
    if ctx < 0:
        raise ValueError(f"KIVI prefill: {lq} queries for a sequence of {seq_len} tokens")
    dt = query.dtype if query.dtype in _COMPUTE_DTYPES else torch.float32
    if context_kv is not None and chunk_kv is None:
        raise ValueError("KIVI prefill: context_kv needs chunk_kv (the chunk's own K/V)")
    exact_ctx = 0 if context_kv is None else context_kv[0].shape[0]
    if exact_ctx > ctx:
        raise ValueError(f"KIVI prefill: {exact_ctx} exact context rows for a context of {ctx}")
    k, v = gather_sequence_kv(cache, block_table_row, seq_len, layout, k_tail=k_tail,
                              tail_entry=tail_entry, backend="torch",
                              length=ctx - exact_ctx if chunk_kv is not None else seq_len)
    if chunk_kv is None:
        k_chunk, v_chunk = k[ctx:], v[ctx:]
    else:
        k_chunk, v_chunk = chunk_kv
        if tuple(k_chunk.shape) != (lq, k.shape[1], d) or k_chunk.shape != v_chunk.shape:
            raise ValueError(f"KIVI prefill: chunk_kv must be two [{lq}, {k.shape[1]}, {d}] "
                             f"tensors; got {tuple(k_chunk.shape)}, {tuple(v_chunk.shape)}")
        if exact_ctx:
            k_ctx, v_ctx = context_kv
            if k_ctx.shape != v_ctx.shape or tuple(k_ctx.shape[1:]) != (k.shape[1], d):
                raise ValueError(f"KIVI prefill: context_kv must be two [e, {k.shape[1]}, {d}] "
                                 f"tensors; got {tuple(k_ctx.shape)}, {tuple(v_ctx.shape)}")
            k = torch.cat((k, k_ctx.to(k.dtype)))
            v = torch.cat((v, v_ctx.to(v.dtype)))
    q = query.to(dt).transpose(0, 1)  # [Hq, lq, D]

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.to(dt).transpose(0, 1).contiguous()

    o, lse = _chunk_part(q, heads_first(k_chunk), heads_first(v_chunk), scale)
    if ctx:
        o_ctx, lse_ctx = _context_part(q.contiguous(), heads_first(k[:ctx]),
                                       heads_first(v[:ctx]), scale)
        o = merge_attention_parts(o, lse, o_ctx, lse_ctx)
    return o.float().transpose(0, 1)
