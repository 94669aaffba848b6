"""Prefill rows on the CPU: the split (context + chunk) flash attention against the torch
reference, which dequantizes the whole sequence and runs one masked SDPA."""

from __future__ import annotations

import pytest
import torch

from vllm_accel.kernels.kivi_attention import kivi_paged_attention
from vllm_accel.kernels.kivi_cache import gather_sequence_kv
from vllm_accel.kernels.kivi_cpu import HAS_NATIVE
from vllm_accel.kernels.kivi_format import KiviLayout
from vllm_accel.kernels.kivi_prefill_cpu import merge_attention_parts, prefill_attention

from .conftest import filled_kivi_cache

# (cached tokens, queries): a whole prompt; context ending inside the unfinished key group
# (its keys come from the tail); context ending on a group boundary; a chunk spanning pages
CASES = [(90, 90), (100, 20), (128, 64), (300, 130), (64, 2)]


def _reference(q, cache, table, seq_len, layout, tail, tail_entry, scale=0.125):
    return kivi_paged_attention(
        q, cache, table[None], torch.tensor([seq_len]), torch.tensor([0, q.shape[0]]), scale,
        layout, k_tail=tail if layout.residual == "tail" else None,
        tail_index=torch.tensor([tail_entry]), backend="torch",
        out=torch.zeros(q.shape, dtype=torch.float32))


@pytest.mark.parametrize("layout", [
    KiviLayout(4, 4, head_size=64, block_size=128, key_group=64),
    KiviLayout(2, 2, head_size=64, block_size=128, key_group=64, dtype=torch.float32),
    KiviLayout(4, 2, head_size=32, block_size=64, key_group=32, value_group=16,
               residual="page"),
], ids=lambda lay: f"K{lay.bits_k}V{lay.bits_v}-{lay.residual}-{lay.dtype}")
@pytest.mark.parametrize("hq, hkv", [(2, 2), (14, 2), (6, 3)])
def test_split_prefill_equals_the_torch_reference(layout, hq, hkv):
    lens = [seq_len for seq_len, _ in CASES]
    cache, tail, table, tail_index = filled_kivi_cache(layout, lens, hkv, seed=11)
    gen = torch.Generator().manual_seed(3)
    for i, (seq_len, lq) in enumerate(CASES):
        q = torch.randn(lq, hq, layout.head_size, generator=gen)
        args = (q, cache, table[i], seq_len, layout, tail, int(tail_index[i]))
        got = prefill_attention(q, cache, table[i], seq_len, 0.125, layout,
                                k_tail=tail if layout.residual == "tail" else None,
                                tail_entry=int(tail_index[i]))
        torch.testing.assert_close(got, _reference(*args), atol=2e-5, rtol=1e-5)


def test_bf16_queries_run_in_bf16_within_its_rounding():
    layout = KiviLayout(4, 4, head_size=64, block_size=128, key_group=64)
    cache, tail, table, tail_index = filled_kivi_cache(layout, [300], 2, seed=4)
    q = torch.randn(130, 14, 64, generator=torch.Generator().manual_seed(5))
    ref = _reference(q, cache, table[0], 300, layout, tail, int(tail_index[0]))
    got = prefill_attention(q.bfloat16(), cache, table[0], 300, 0.125, layout, k_tail=tail,
                            tail_entry=int(tail_index[0]))
    err = (got - ref).abs().max().item()
    assert 0 < err < 2e-2  # bf16 operands (so not the fp32 path), fp32 accumulation


def test_chunk_kv_replaces_only_the_chunks_own_positions():
    """With the step's own K/V given, the chunk attends to them and the context still comes
    from the cache: equal to the reference over a cache whose chunk rows hold those K/V."""
    layout = KiviLayout(4, 4, head_size=64, block_size=128, key_group=64, dtype=torch.float32)
    seq_len, lq, hq, hkv = 300, 130, 6, 2
    cache, tail, table, tail_index = filled_kivi_cache(layout, [seq_len], hkv, seed=8)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(lq, hq, 64, generator=gen)
    k_own, v_own = torch.randn(lq, hkv, 64, generator=gen), torch.randn(lq, hkv, 64, generator=gen)
    got = prefill_attention(q, cache, table[0], seq_len, 0.125, layout, k_tail=tail,
                            tail_entry=int(tail_index[0]), chunk_kv=(k_own, v_own))
    k, v = gather_sequence_kv(cache, table[0], seq_len, layout, k_tail=tail,
                              tail_entry=int(tail_index[0]))
    k[seq_len - lq:], v[seq_len - lq:] = k_own, v_own
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - lq, seq_len)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.125,
        enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    cached = prefill_attention(q, cache, table[0], seq_len, 0.125, layout, k_tail=tail,
                               tail_entry=int(tail_index[0]))
    assert (cached - got).abs().max() > 0.1  # the chunk's own K/V were really used
    with pytest.raises(ValueError, match="chunk_kv must be two"):
        prefill_attention(q, cache, table[0], seq_len, 0.125, layout, k_tail=tail,
                          tail_entry=int(tail_index[0]), chunk_kv=(k_own[1:], v_own[1:]))


def test_merge_equals_attention_over_the_union_of_the_key_sets():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 7, 16, generator=gen)
    k, v = torch.randn(3, 50, 16, generator=gen) * 2, torch.randn(3, 50, 16, generator=gen)

    def part(sl):
        s = q @ k[:, sl].transpose(1, 2)
        return torch.softmax(s, -1) @ v[:, sl], torch.logsumexp(s, -1)

    merged = merge_attention_parts(*part(slice(0, 20)), *part(slice(20, 50)))
    want = torch.softmax(q @ k.transpose(1, 2), -1) @ v
    torch.testing.assert_close(merged, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_NATIVE, reason="vllm_accel._C_kivi is not built")
def test_mixed_batch_with_chunk_kv_native_equals_reference():
    """A decode row, a 2-row draft verification (below ``chunk_kv_min_rows=3``: read from the
    cache) and a 40-row prefill chunk (its own rows from ``chunk_kv``): the native path (decode
    kernel + split prefill) equals the torch reference, and only the chunk changed."""
    layout = KiviLayout(4, 4, head_size=64, block_size=128, key_group=64, dtype=torch.float32)
    seq_lens = [150, 90, 200]
    cache, tail, table, tail_index = filled_kivi_cache(layout, seq_lens, 2, seed=6)
    qsl = torch.tensor([0, 1, 3, 43])
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(43, 6, 64, generator=gen)
    own = (torch.randn(43, 2, 64, generator=gen), torch.randn(43, 2, 64, generator=gen))

    def run(backend, chunk_kv):
        return kivi_paged_attention(
            q, cache, table, torch.tensor(seq_lens), qsl, 0.125, layout, k_tail=tail,
            tail_index=tail_index, backend=backend, out=torch.zeros(q.shape),
            chunk_kv=chunk_kv, chunk_kv_min_rows=3)

    native, ref, cached = run("native", own), run("torch", own), run("torch", None)
    torch.testing.assert_close(native, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ref[:3], cached[:3])
    assert (ref[3:] - cached[3:]).abs().max() > 0.1


@pytest.mark.parametrize("exact_ctx", [0, 37, 170])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_context_kv_makes_a_later_chunk_read_earlier_chunks_unquantized(exact_ctx, backend):
    """A prompt of 300 tokens whose last 130 are this step: with ``context_kv`` holding the
    unquantized K/V of the last ``exact_ctx`` context positions (the earlier steps of the same
    prompt) the chunk attends to exactly those, to the cache for the positions before them;
    with the whole context given it equals attention over the unquantized prompt."""
    if backend == "native" and not HAS_NATIVE:
        pytest.skip("vllm_accel._C_kivi is not built")
    layout = KiviLayout(4, 4, head_size=64, block_size=128, key_group=64, dtype=torch.float32)
    seq_len, lq, hq, hkv = 300, 130, 6, 2
    ctx = seq_len - lq
    gen = torch.Generator().manual_seed(21)
    k_all, v_all = torch.randn(seq_len, hkv, 64, generator=gen), torch.randn(seq_len, hkv, 64,
                                                                            generator=gen)
    cache, tail, table, tail_index = filled_kivi_cache(layout, [seq_len], hkv, seed=8,
                                                       kv=(k_all, v_all))
    q = torch.randn(lq, hq, 64, generator=gen)
    context = (k_all[ctx - exact_ctx:ctx], v_all[ctx - exact_ctx:ctx])
    got = kivi_paged_attention(
        q, cache, table, torch.tensor([seq_len]), torch.tensor([0, lq]), 0.125, layout,
        k_tail=tail, tail_index=tail_index, backend=backend, out=torch.zeros(q.shape),
        chunk_kv=(k_all[ctx:], v_all[ctx:]), context_kv=[context])
    k, v = gather_sequence_kv(cache, table[0], seq_len, layout, k_tail=tail,
                              tail_entry=int(tail_index[0]))
    exact_from = ctx - exact_ctx
    k[exact_from:], v[exact_from:] = k_all[exact_from:], v_all[exact_from:]
    mask = torch.arange(seq_len)[None, :] <= torch.arange(ctx, seq_len)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.125,
        enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    if exact_ctx == ctx:  # the whole prompt unquantized
        unquantized = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1), attn_mask=mask,
            scale=0.125, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(got, unquantized, atol=2e-5, rtol=1e-5)


def test_context_kv_needs_chunk_kv_and_fitting_shapes():
    layout = KiviLayout(4, 4, head_size=64, block_size=128, key_group=64, dtype=torch.float32)
    cache, tail, table, tail_index = filled_kivi_cache(layout, [300], 2, seed=8)
    q, own = torch.randn(130, 2, 64), (torch.randn(130, 2, 64), torch.randn(130, 2, 64))
    kw = {"k_tail": tail, "tail_entry": int(tail_index[0])}
    with pytest.raises(ValueError, match="context_kv needs chunk_kv"):
        prefill_attention(q, cache, table[0], 300, 0.125, layout, context_kv=own, **kw)
    with pytest.raises(ValueError, match="exact context rows for a context of 170"):
        prefill_attention(q, cache, table[0], 300, 0.125, layout, chunk_kv=own,
                          context_kv=(torch.randn(171, 2, 64), torch.randn(171, 2, 64)), **kw)
    with pytest.raises(ValueError, match="context_kv must be two"):
        prefill_attention(q, cache, table[0], 300, 0.125, layout, chunk_kv=own,
                          context_kv=(torch.randn(10, 1, 64), torch.randn(10, 1, 64)), **kw)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_value_rotation_leaves_a_one_step_prompt_exact(backend):
    """A prompt prefilled in one step attends only to its own unquantized rows: rotating the
    values in (``chunk_kv``) and the output back changes nothing but float rounding."""
    if backend == "native" and not HAS_NATIVE:
        pytest.skip("vllm_accel._C_kivi is not built")
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(90, 6, 64, generator=gen)
    own = (torch.randn(90, 2, 64, generator=gen), torch.randn(90, 2, 64, generator=gen))
    own[1][..., 5] *= 30  # an outlier value channel: rotation would matter if it were quantized
    outs = []
    for rotation in ("none", "hadamard"):
        layout = KiviLayout(4, 4, head_size=64, block_size=128, key_group=64,
                            dtype=torch.float32, value_rotation=rotation)
        cache, tail, table, tail_index = filled_kivi_cache(layout, [90], 2, seed=6)
        outs.append(kivi_paged_attention(
            q, cache, table, torch.tensor([90]), torch.tensor([0, 90]), 0.125, layout,
            k_tail=tail, tail_index=tail_index, backend=backend, out=torch.zeros(q.shape),
            chunk_kv=own, chunk_kv_min_rows=2))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-5)
