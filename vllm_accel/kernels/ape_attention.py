"""APE-style attention over reused chunks: a temperature and a scale for the chunk segment.

Reused document chunks were encoded apart from each other (or in another context), so a query
that attends to all of them at once sees an attention distribution unlike the one of a full,
sequential encoding: too flat over the many chunk tokens, and with each chunk's leftover
attention-sink mass. APE (Yang et al., "Adaptive Parallel Encoding", ICLR 2025) realigns it
without training. The keys visible to a query split into two segments,

* ``C``: the reused chunk tokens (``chunk_mask``), and
* ``R``: everything else (the system prefix, the question, the generated tokens),

each attended to on its own, and the two results merged by their log-sum-exp, with the chunk
segment's logits divided by the temperature ``T`` and its log-sum-exp multiplied by ``S * T``::

    lse_C = logsumexp(s_C / T)     o_C = softmax(s_C / T) @ V_C
    lse_R = logsumexp(s_R)         o_R = softmax(s_R) @ V_R
    out   = (e^{S T lse_C} o_C + e^{lse_R} o_R) / (e^{S T lse_C} + e^{lse_R})

where ``s = scale * q . k`` over the causally visible keys. ``T < 1`` sharpens attention inside
the chunks; ``T * lse_C(T)`` tends to the chunk segment's largest logit, so the segment keeps the
weight its best match deserves, and ``S`` scales that log-weight (APE tunes both per model).
``T = S = 1`` is exactly ordinary causal attention (the merge of two softmaxes by their
log-sum-exp).

Plain torch (no vLLM): the connector's attention adapter (``kv_connector/ape.py``) calls it for
the rows of requests that reuse chunks.

    >>> import torch
    >>> torch.manual_seed(0) and None
    >>> q, k, v = torch.randn(3, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    >>> pos, chunk = torch.tensor([7, 8, 9]), torch.arange(10).lt(6) & torch.arange(10).ge(1)
    >>> exact = ape_attention(q, k, v, pos, chunk, scale=8 ** -0.5)
    >>> bool(torch.allclose(exact, causal_attention_reference(q, k, v, pos, 8 ** -0.5), atol=1e-5))
    True
    >>> sharp = ape_attention(q, k, v, pos, chunk, 8 ** -0.5, temperature=0.5, chunk_scale=0.9)
    >>> want = ape_attention_reference(q, k, v, pos, chunk, 8 ** -0.5, 0.5, 0.9)
    >>> bool(torch.allclose(sharp, want, atol=1e-5))
    True
"""

from __future__ import annotations

import torch

_QUERY_ROWS_PER_BLOCK = 256


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``q [n, H, D]``, ``k/v [S, Hkv, D]`` -> ``q [Hkv, g*n, D]``, ``k/v [Hkv, S, D]``, float32."""
    n, num_heads, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.float().reshape(n, kv_heads, num_heads // kv_heads, dim).permute(1, 2, 0, 3)
    return (qg.reshape(kv_heads, -1, dim), k.float().transpose(0, 1),
            v.float().transpose(0, 1))


def _segment(logits: torch.Tensor, visible: torch.Tensor, values: torch.Tensor):
    """(log-sum-exp, softmax @ values) over ``visible`` keys; an empty segment gives
    (-inf, 0)."""
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.exp(logits - lse.clamp_min(torch.finfo(logits.dtype).min))
    return lse, probs @ values


def ape_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                  chunk_mask: torch.Tensor, scale: float, temperature: float = 1.0,
                  chunk_scale: float = 1.0) -> torch.Tensor:
    """APE attention of one request's query rows over its keys.

    ``q [n, H, D]`` at ``q_positions [n]``; ``k, v [S, Hkv, D]`` are the KV of positions
    ``0 .. S-1`` (``H`` a multiple of ``Hkv``); ``chunk_mask [S]`` marks the reused chunk
    tokens. Key ``j`` is visible to row ``i`` when ``j <= q_positions[i]``. Returns
    ``[n, H, D]`` in ``q``'s dtype.
    """
    n, num_heads, dim = q.shape
    kv_heads = k.shape[1]
    qg, kg, vg = _grouped(q, k, v)
    key_pos = torch.arange(k.shape[0], device=q.device)
    chunk = chunk_mask.to(device=q.device, dtype=torch.bool)
    out = torch.empty(kv_heads, qg.shape[1], dim, device=q.device, dtype=torch.float32)
    group = num_heads // kv_heads
    positions = q_positions.to(q.device).repeat(group)  # row order of qg: (group, n)
    for lo in range(0, qg.shape[1], _QUERY_ROWS_PER_BLOCK):
        hi = min(qg.shape[1], lo + _QUERY_ROWS_PER_BLOCK)
        logits = (qg[:, lo:hi] @ kg.transpose(1, 2)) * scale  # [Hkv, rows, S]
        visible = (key_pos[None, :] <= positions[lo:hi, None])[None]
        lse_c, out_c = _segment(logits / temperature, visible & chunk, vg)
        lse_r, out_r = _segment(logits, visible & ~chunk, vg)
        weights = torch.softmax(torch.cat([chunk_scale * temperature * lse_c, lse_r], -1), -1)
        out[:, lo:hi] = weights[..., :1] * out_c + weights[..., 1:] * out_r
    out = out.reshape(kv_heads, group, n, dim).permute(2, 0, 1, 3)
    return out.reshape(n, num_heads, dim).to(q.dtype)


def ape_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            q_positions: torch.Tensor, chunk_mask: torch.Tensor, scale: float,
                            temperature: float = 1.0, chunk_scale: float = 1.0) -> torch.Tensor:
    """The definition, one row and one head at a time (tests only)."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, pos in enumerate(q_positions.tolist()):
        for h in range(q.shape[1]):
            s = (k[: pos + 1, h // group].double() @ q[i, h].double()) * scale
            c = chunk_mask[: pos + 1].bool()
            vals = v[: pos + 1, h // group].double()
            parts = []
            if c.any():
                sc = s[c] / temperature
                parts.append((chunk_scale * temperature * torch.logsumexp(sc, 0),
                              torch.softmax(sc, 0) @ vals[c]))
            sr = s[~c]
            parts.append((torch.logsumexp(sr, 0), torch.softmax(sr, 0) @ vals[~c]))
            w = torch.softmax(torch.stack([p[0] for p in parts]), 0)
            out[i, h] = sum(wj * p[1] for wj, p in zip(w, parts))
    return out.to(q.dtype)


def causal_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               q_positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Ordinary causal attention with SDPA (what ``T = S = 1`` must equal)."""
    visible = torch.arange(k.shape[0])[None, :] <= q_positions[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=visible[None, None], scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
