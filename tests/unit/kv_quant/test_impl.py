"""The backend's Impl and Builder on a hand-made batch: write, then attend, like vLLM calls them."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_accel.kernels.kivi_format import fake_quant_kv, reference_attention
from vllm_accel.kv_quant.backend import (
    KiviAttentionImpl,
    KiviAttentionMetadata,
    page_layout,
)
from vllm_accel.kv_quant.config import KvQuantKnobs
from vllm_accel.kv_quant.tail_pool import TailPool

H_Q, H_KV, D, N = 4, 2, 64, 128


def _metadata(q_lens, seq_lens, block_table, slot_mapping, pool=None, rows=None, live=None):
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    tail_mapping = tail_index = None
    if pool is not None:
        tail_mapping, tail_index = pool.step(rows, live, qsl, seq_lens, int(qsl[-1]))
    return KiviAttentionMetadata(
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()), query_start_loc=qsl, seq_lens=seq_lens,
        block_table=block_table, slot_mapping=slot_mapping, tail_pool=pool,
        tail_mapping=tail_mapping, tail_index=tail_index)


def _impl(residual, prefill_kv="cache", **format_knobs):
    impl = KiviAttentionImpl(H_Q, D, D**-0.5, H_KV, None, None, "kivi_4bit")
    impl.knobs = KvQuantKnobs(residual=residual, prefill_kv=prefill_kv, **format_knobs)
    impl.exact_prefill = prefill_kv == "exact"
    return impl


def _pool(max_requests=2, key_group=64):
    return TailPool(["L0"], num_kv_heads=H_KV, key_group=key_group, head_size=D,
                    dtype=torch.bfloat16, device="cpu", max_requests=max_requests,
                    entries_per_slot=1)


def _slots(block_table_row, positions):
    return torch.tensor([int(block_table_row[p // N]) * N + p % N for p in positions])


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
@pytest.mark.parametrize("prefill_kv", ["cache", "exact"])
@pytest.mark.parametrize("residual", ["tail", "page"])
def test_prefill_then_decode_matches_the_fake_quant_reference(residual, prefill_kv, rotation):
    torch.manual_seed(0)
    knobs = KvQuantKnobs(residual=residual, value_rotation=rotation)
    layout = page_layout("kivi_4bit", D, N, knobs=knobs)
    assert layout.value_rotation == rotation
    cache = layout.allocate(num_blocks=4, num_kv_heads=H_KV)
    impl = _impl(residual, prefill_kv, value_rotation=rotation)
    pool = _pool() if residual == "tail" else None
    layer = types.SimpleNamespace(layer_name="L0")
    length = 150  # two pages: one full key group + a partial one on the second page
    q = torch.randn(length, H_Q, D, dtype=torch.bfloat16)
    k = torch.randn(length, H_KV, D, dtype=torch.bfloat16)
    v = torch.randn(length, H_KV, D, dtype=torch.bfloat16)
    block_table = torch.tensor([[2, 0]], dtype=torch.int32)
    slots = _slots(block_table[0], range(length))

    # prefill of the first length-1 tokens, then one decode token
    out = torch.zeros(length, H_Q, D, dtype=torch.bfloat16)
    pre = length - 1
    for lo, hi in ((0, pre), (pre, length)):
        md = _metadata([hi - lo], [hi], block_table, slots[lo:hi], pool, ["r"], {"r"})
        impl.write(layer, k[lo:hi], v[lo:hi], cache, slots[lo:hi], md)
        impl.forward(layer, q[lo:hi], k[lo:hi], v[lo:hi], cache, md, out[lo:hi])

    kq, vq = fake_quant_kv(k, v, layout)
    want_decode = reference_attention(q[pre:], kq, vq)
    torch.testing.assert_close(out[pre:].float(), want_decode, atol=2e-2, rtol=2e-2)
    # the prefill rows attend to what the cache held after the prefill write ("cache"), or
    # to the prompt's own unquantized K/V ("exact", the default on CPU)
    kq_pre, vq_pre = fake_quant_kv(k[:pre], v[:pre], layout)
    want_pre = reference_attention(q[:pre], kq_pre, vq_pre)
    exact_pre = reference_attention(q[:pre], k[:pre].float(), v[:pre].float())
    want, other = (want_pre, exact_pre) if prefill_kv == "cache" else (exact_pre, want_pre)
    torch.testing.assert_close(out[:pre].float(), want, atol=2e-2, rtol=2e-2)
    assert (out[:pre].float() - other).abs().max() > 0.05


@pytest.mark.parametrize("residual", ["tail", "page"])
def test_format_knobs_change_the_page_and_attention_reads_it(residual):
    """key_group 32, value_group 16 and 4 sink slots: the impl builds that layout for the cache
    it is given, writes it and attends to it as the fake-quant reference of the same layout."""
    torch.manual_seed(2)
    fmt = dict(key_group=32, value_group=16, sink_tokens=4)
    layout = page_layout("kivi_4bit", D, N, knobs=KvQuantKnobs(residual=residual, **fmt))
    default = page_layout("kivi_4bit", D, N, knobs=KvQuantKnobs(residual=residual))
    assert (layout.key_group, layout.value_group, layout.sink_tokens) == (32, 16, 4)
    # smaller groups and sink copies cost bytes per token: key scales 4*64/32 instead of
    # 4*64/64, value scales 4*64/16 instead of 4, and 4 bf16 sink rows of K and V per 128 tokens;
    # an in-page residual area holds one 32-token key group instead of 64 (2*32*64/128 B less)
    smaller_residual = 32 if residual == "page" else 0
    assert (layout.bytes_per_token_head
            == default.bytes_per_token_head + 4 + 12 + 8 - smaller_residual)
    cache = layout.allocate(num_blocks=3, num_kv_heads=H_KV)
    impl = _impl(residual, **fmt)
    pool = _pool(key_group=32) if residual == "tail" else None
    layer = types.SimpleNamespace(layer_name="L0")
    length = 170
    q = torch.randn(length, H_Q, D, dtype=torch.bfloat16)
    k = torch.randn(length, H_KV, D, dtype=torch.bfloat16)
    v = torch.randn(length, H_KV, D, dtype=torch.bfloat16)
    k[:4] *= 20  # sink rows far outside the range of the rest: kept exactly, out of min/max
    block_table = torch.tensor([[1, 2]], dtype=torch.int32)
    slots = _slots(block_table[0], range(length))
    out = torch.zeros(length, H_Q, D, dtype=torch.bfloat16)
    for lo, hi in ((0, length - 1), (length - 1, length)):
        md = _metadata([hi - lo], [hi], block_table, slots[lo:hi], pool, ["r"], {"r"})
        impl.write(layer, k[lo:hi], v[lo:hi], cache, slots[lo:hi], md)
        impl.forward(layer, q[lo:hi], k[lo:hi], v[lo:hi], cache, md, out[lo:hi])
    assert impl.layout_for(cache) == layout
    kq, vq = fake_quant_kv(k, v, layout)
    torch.testing.assert_close(kq[:4], k[:4].float())
    torch.testing.assert_close(out[-1:].float(), reference_attention(q[-1:], kq, vq),
                               atol=2e-2, rtol=2e-2)
    kq_default, vq_default = fake_quant_kv(k, v, default)
    off = reference_attention(q[-1:], kq_default, vq_default)
    assert (out[-1:].float() - off).abs().max() > 2e-2  # the knobs did change what is read


def test_tail_slots_follow_requests_across_row_moves_and_finishes():
    """Two requests decode in alternating row order; one finishes and a third takes its slot
    mid-group: every decode output still matches the reference of its own sequence."""
    torch.manual_seed(1)
    layout = page_layout("kivi_4bit", D, N)
    cache = layout.allocate(num_blocks=6, num_kv_heads=H_KV)
    impl, pool = _impl("tail"), _pool(max_requests=2)
    layer = types.SimpleNamespace(layer_name="L0")
    tables = {"a": [1, 2], "b": [3, 4], "c": [5, 0]}
    seqs = {r: [torch.randn(200, h, D, dtype=torch.bfloat16) for h in (H_Q, H_KV, H_KV)]
            for r in tables}
    done = {r: 0 for r in tables}

    def step(rows, q_lens, live):
        table = torch.tensor([tables[r] for r in rows], dtype=torch.int32)
        los = [done[r] for r in rows]
        his = [lo + n for lo, n in zip(los, q_lens)]
        slots = torch.cat([_slots(table[i], range(lo, hi))
                           for i, (lo, hi) in enumerate(zip(los, his))])
        q, k, v = (torch.cat([seqs[r][j][lo:hi] for r, lo, hi in zip(rows, los, his)])
                   for j in range(3))
        md = _metadata(q_lens, his, table, slots, pool, rows, live)
        out = torch.zeros_like(q)
        impl.write(layer, k, v, cache, slots, md)
        impl.forward(layer, q, k, v, cache, md, out)
        for r, hi in zip(rows, his):
            done[r] = hi
        return out, his

    step(["a", "b"], [70, 30], {"a", "b"})  # a: one full group + 6 residual keys
    for rows in (["b", "a"], ["a", "b"], ["b", "a"]):
        out, his = step(rows, [1, 1], {"a", "b"})
        for i, (r, hi) in enumerate(zip(rows, his)):
            q, k, v = (t[:hi] for t in seqs[r])
            kq, vq = fake_quant_kv(k, v, layout)
            want = reference_attention(q[hi - 1:], kq, vq)
            torch.testing.assert_close(out[i:i + 1].float(), want, atol=2e-2, rtol=2e-2)
    step(["c"], [40], {"a", "c"})  # b finished: c gets its slot
    assert pool.slots.capacity == 2
    out, his = step(["a", "c"], [1, 1], {"a", "c"})
    for i, r in enumerate(["a", "c"]):
        q, k, v = (t[:his[i]] for t in seqs[r])
        kq, vq = fake_quant_kv(k, v, layout)
        want = reference_attention(q[his[i] - 1:], kq, vq)
        torch.testing.assert_close(out[i:i + 1].float(), want, atol=2e-2, rtol=2e-2)


def test_pool_grows_when_more_requests_are_live_than_slots():
    pool = _pool(max_requests=1)
    qsl, seq_lens = torch.tensor([0, 1, 2]), torch.tensor([5, 9])
    pool.keys[:, 1] = 3.0  # request "a"'s slot
    pool.step(["a"], {"a"}, qsl[:2], seq_lens[:1], 1)
    _, tail_index = pool.step(["a", "b"], {"a", "b"}, qsl, seq_lens, 2)
    assert pool.slots.capacity >= 2 and tail_index.tolist() == [1, 2]
    assert bool((pool.keys[:, 1] == 3.0).all())  # kept across the growth


def test_rows_without_a_live_request_write_into_the_scratch_slot():
    pool = _pool(max_requests=1)
    qsl, seq_lens = torch.tensor([0, 2, 3]), torch.tensor([2, 1])
    tail_mapping, tail_index = pool.step([None, "gone"], {"a"}, qsl, seq_lens, 3,
                                         padded_tokens=5)
    assert tail_mapping.tolist() == [0, 0, 0, 0, 0] and tail_index.tolist() == [0, 0]
    assert len(pool.slots) == 0


def test_profiling_run_leaves_output_untouched():
    impl = KiviAttentionImpl(H_Q, D, D**-0.5, H_KV, None, None, "kivi_2bit")
    out = torch.full((3, H_Q, D), 7.0)
    cache = page_layout("kivi_2bit", D, N).allocate(1, H_KV)
    assert impl.forward(None, out, out, out, cache, None, out) is out
    assert bool((out == 7.0).all())


def test_cache_with_other_page_bytes_is_refused():
    impl = KiviAttentionImpl(H_Q, D, D**-0.5, H_KV, None, None, "kivi_4bit")
    wrong = page_layout("kivi_2bit", D, N).allocate(1, H_KV)  # 40 B/token, not 72
    with pytest.raises(RuntimeError, match="40 bytes per token.*needs 72"):
        impl.layout_for(wrong)


@pytest.mark.parametrize("kwargs, message", [
    (dict(sliding_window=256), "sliding window"),
    (dict(alibi_slopes=[1.0] * H_Q), "ALiBi"),
    (dict(logits_soft_cap=30.0), "soft-capping"),
])
def test_unsupported_layer_features_are_refused(kwargs, message):
    args = dict(num_heads=H_Q, head_size=D, scale=1.0, num_kv_heads=H_KV, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="kivi_4bit")
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"--kv-cache-dtype kivi_4bit does not support.*{message}"):
        KiviAttentionImpl(**args)
