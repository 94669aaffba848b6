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

H_Q, H_KV, D, N = 4, 2, 64, 128


def _metadata(q_lens, seq_lens, block_table, slot_mapping):
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return KiviAttentionMetadata(
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table, slot_mapping=slot_mapping)


def test_prefill_then_decode_matches_the_fake_quant_reference():
    torch.manual_seed(0)
    layout = page_layout("kivi_4bit", D, N)
    cache = layout.allocate(num_blocks=4, num_kv_heads=H_KV)
    impl = KiviAttentionImpl(H_Q, D, D**-0.5, H_KV, None, None, "kivi_4bit")
    layer = types.SimpleNamespace()
    length = 150  # two pages: one full key group + a partial one on the second page
    q = torch.randn(length, H_Q, D, dtype=torch.bfloat16)
    k = torch.randn(length, H_KV, D, dtype=torch.bfloat16)
    v = torch.randn(length, H_KV, D, dtype=torch.bfloat16)
    block_table = torch.tensor([[2, 0]], dtype=torch.int32)
    slots = torch.tensor([int(block_table[0, p // N]) * N + p % N for p in range(length)])

    # prefill of the first length-1 tokens, then one decode token
    out = torch.zeros(length, H_Q, D, dtype=torch.bfloat16)
    pre = length - 1
    md = _metadata([pre], [pre], block_table, slots[:pre])
    impl.do_kv_cache_update(layer, k[:pre], v[:pre], cache, slots[:pre])
    impl.forward(layer, q[:pre], k[:pre], v[:pre], cache, md, out[:pre])
    md = _metadata([1], [length], block_table, slots[pre:])
    impl.do_kv_cache_update(layer, k[pre:], v[pre:], cache, slots[pre:])
    impl.forward(layer, q[pre:], k[pre:], v[pre:], cache, md, out[pre:])

    kq, vq = fake_quant_kv(k, v, layout)
    want_decode = reference_attention(q[pre:], kq, vq)
    torch.testing.assert_close(out[pre:].float(), want_decode, atol=2e-2, rtol=2e-2)
    # the prefill rows attend to what the cache held after the prefill write
    kq_pre, vq_pre = fake_quant_kv(k[:pre], v[:pre], layout)
    want_pre = reference_attention(q[:pre], kq_pre, vq_pre)
    torch.testing.assert_close(out[:pre].float(), want_pre, atol=2e-2, rtol=2e-2)


def test_profiling_run_leaves_output_untouched():
    impl = KiviAttentionImpl(H_Q, D, D**-0.5, H_KV, None, None, "kivi_2bit")
    out = torch.full((3, H_Q, D), 7.0)
    cache = page_layout("kivi_2bit", D, N).allocate(1, H_KV)
    assert impl.forward(None, out, out, out, cache, None, out) is out
    assert bool((out == 7.0).all())


def test_cache_with_other_page_bytes_is_refused():
    impl = KiviAttentionImpl(H_Q, D, D**-0.5, H_KV, None, None, "kivi_4bit")
    wrong = page_layout("kivi_2bit", D, N).allocate(1, H_KV)  # 104 B/token, not 136
    with pytest.raises(RuntimeError, match="104 bytes per token.*needs 136"):
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
