"""SPEED upper-layer attention over paged KV vs the per-token float64 definition."""

from __future__ import annotations

import pytest
import torch

from vllm_accel.kernels.speed_attention import (
    speed_upper_attention,
    speed_upper_attention_reference,
    upper_active,
)

from .conftest import requires_triton_interpreter

# the torch path, and the Triton kernel in the CPU interpreter
BACKENDS = ["torch", pytest.param("triton", marks=requires_triton_interpreter)]

PAGE, HQ, HKV, D = 8, 4, 2, 16


def _case(requests, anchor, seed=0, null_gap=True, page_size=PAGE):
    """requests: (prompt_len, seq_len, query positions). Pages of every request are scattered;
    positions that hold no upper-layer KV are garbage, and with ``null_gap`` the pages entirely
    inside the skipped range point at page 0, which is filled with NaN (vLLM's null block)."""
    g = torch.Generator().manual_seed(seed)
    max_pages = max(-(-s // page_size) for _, s, _ in requests)
    num_pages = 1 + sum(-(-s // page_size) for _, s, _ in requests)
    k_pages = torch.randn(num_pages, page_size, HKV, D, generator=g)
    v_pages = torch.randn(num_pages, page_size, HKV, D, generator=g)
    k_pages[0] = v_pages[0] = float("nan")
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(requests), max_pages, dtype=torch.int32)
    keys, values, qpos, qsl = [], [], [], [0]
    for r, (prompt, seq, positions) in enumerate(requests):
        n = -(-seq // page_size)
        table[r, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
        pos = torch.arange(seq)
        active = upper_active(pos, torch.tensor(prompt), anchor)
        for p in pos[~active].tolist():  # never written in the upper layers: garbage
            k_pages[table[r, p // page_size], p % page_size] = 1e4
            v_pages[table[r, p // page_size], p % page_size] = 1e4
        if null_gap:
            for page in range(n):
                span = torch.arange(page * page_size, min((page + 1) * page_size, seq))
                if not upper_active(span, torch.tensor(prompt), anchor).any():
                    table[r, page] = 0
        slots = [(table[r, p // page_size], p % page_size) for p in range(seq)]
        keys.append(torch.stack([k_pages[page, i] for page, i in slots]))
        values.append(torch.stack([v_pages[page, i] for page, i in slots]))
        qpos += positions
        qsl.append(qsl[-1] + len(positions))
    query = torch.randn(qsl[-1], HQ, D, generator=g)
    return query, torch.tensor(qpos), qsl, k_pages, v_pages, table, keys, values


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("anchor", [1, 3])
def test_matches_definition_for_mixed_batch(anchor, backend):
    requests = [
        (50, 50, [*range(anchor), 49]),  # prefill: the anchors and the last prompt token
        (40, 45, [44]),  # decode, 6 generated so far
        (33, 37, [34, 35, 36]),  # spec-decode verification: 3 queries
        (2, 6, [5]),  # prompt shorter than the anchor: everything visible
        (64, 64, []),  # a request with no upper-active token in this step (non-final chunk)
        (17, 70, [69]),  # long decode spanning several tail pages
    ]
    query, qpos, qsl, kp, vp, table, keys, values = _case(requests, anchor)
    seq_lens = [s for _, s, _ in requests]
    prompts = [p for p, _, _ in requests]
    out = speed_upper_attention(query, qpos, qsl, kp, vp, table, seq_lens, prompts, anchor,
                                D ** -0.5, backend=backend)
    # the reference reads only the visible positions of each request's key list
    ref = speed_upper_attention_reference(query, qpos, qsl, [k[:s] for k, s in
                                                             zip(keys, seq_lens)],
                                          values, prompts, anchor, D ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_visibility_really_restricted(backend):
    """The same queries with every position visible (cut = every layer) give another result:
    the mask acts, and the garbage in the skipped range is never read."""
    requests = [(40, 45, [44])]
    query, qpos, qsl, kp, vp, table, keys, values = _case(requests, 1, null_gap=False)
    out = speed_upper_attention(query, qpos, qsl, kp, vp, table, [45], [40], 1, D ** -0.5,
                                backend=backend)
    assert out.abs().max() < 100  # 1e4 garbage values would dominate if read
    dense = speed_upper_attention(query, qpos, qsl, kp, vp, table, [45], [1], 1, D ** -0.5,
                                  backend=backend)
    assert dense.abs().max() > 1000  # prompt_len 1: every position is upper-active


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_close_to_definition(backend):
    requests = [(30, 34, [33]), (20, 20, [0, 19])]
    query, qpos, qsl, kp, vp, table, keys, values = _case(requests, 1, seed=3)
    out = speed_upper_attention(query.bfloat16(), qpos, qsl, kp.bfloat16(), vp.bfloat16(),
                                table, [34, 20], [30, 20], 1, D ** -0.5, backend=backend)
    ref = speed_upper_attention_reference(query, qpos, qsl, keys, values, [30, 20], 1, D ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


@requires_triton_interpreter
def test_triton_with_pages_larger_than_a_key_block_and_many_queries():
    """Pages of 64 keys (two key blocks each) and more queries than one query tile."""
    requests = [(150, 170, [*range(150 - 1, 170)]),  # 22 rows: two query tiles
                (3, 40, [39])]
    query, qpos, qsl, kp, vp, table, keys, values = _case(requests, 2, seed=5, page_size=64)
    out = speed_upper_attention(query, qpos, qsl, kp, vp, table, [170, 40], [150, 3], 2,
                                D ** -0.5, backend="triton")
    ref = speed_upper_attention_reference(query, qpos, qsl, keys, values, [150, 3], 2,
                                          D ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
