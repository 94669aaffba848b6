"""The buffer of unquantized prompt K/V between prefill steps (``prompt_exact_tokens``): its
plan per step, and a prompt prefilled in several steps through the Impl, which then computes
what one-step prefill computes."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_accel.kernels.kivi_format import reference_attention
from vllm_accel.kv_quant.backend import KiviAttentionImpl, KiviAttentionMetadata, page_layout
from vllm_accel.kv_quant.config import KvQuantKnobs
from vllm_accel.kv_quant.prompt_kv import PromptKvBuffer, buffer_bytes
from vllm_accel.kv_quant.tail_pool import TailPool

H_Q, H_KV, D, N = 4, 2, 64, 128
MIN_ROWS = 2


def _plan(buf, rows, q_lens, seq_lens, prompt_lens, live=None):
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    return buf.plan(rows, set(rows) if live is None else live, qsl, seq_lens, prompt_lens,
                    MIN_ROWS)


def test_a_prompt_is_kept_until_its_last_prefill_step():
    buf = PromptKvBuffer(1000)
    step = _plan(buf, ["a"], [128], [128], [300])
    assert step.context("L0") == [None] and buf.held_tokens() == 128
    step.store("L0", torch.arange(128.).view(128, 1, 1), -torch.arange(128.).view(128, 1, 1))
    step = _plan(buf, ["a"], [128], [256], [300])
    k, v = step.context("L0")[0]
    assert k.flatten().tolist() == list(range(128)) and v.flatten().tolist()[5] == -5
    step.store("L0", torch.arange(128., 256.).view(128, 1, 1), torch.zeros(128, 1, 1))
    assert buf.held_tokens() == 256
    step = _plan(buf, ["a"], [44], [300], [300])  # the last step reads, keeps nothing
    assert step.context("L0")[0][0].flatten().tolist() == list(range(256))
    assert buf.held_tokens() == 0


def test_decode_rows_gone_requests_and_a_moved_context_end_an_entry():
    buf = PromptKvBuffer(1000)
    _plan(buf, ["a", "b", "c"], [100, 100, 100], [100, 100, 100], [500, 500, 500])
    assert buf.held_tokens() == 300
    # a: decode-sized step; b: its context is not where the entry ends (preempted and
    # recomputed); c: the runner dropped it
    step = _plan(buf, ["a", "b"], [1, 50], [101, 50], [500, 500], live={"a", "b"})
    assert step.context("L0") == [None, None]
    assert buf.held_tokens() == 50  # b's new entry only
    assert _plan(buf, ["a"], [1], [102], [500], live={"a"}) is None and buf.held_tokens() == 0


def test_capacity_is_shared_and_keeps_the_latest_tokens():
    buf = PromptKvBuffer(150)
    step = _plan(buf, ["a", "b"], [100, 100], [100, 100], [500, 500])
    assert [row.keep for row in step.rows.values()] == [100, 50]
    k = torch.arange(200.).view(200, 1, 1)
    step.store("L0", k, k)
    step = _plan(buf, ["b"], [10], [110], [500], live={"a", "b"})  # a still holds 100
    assert step.context("L0")[0][0].flatten().tolist() == list(range(150, 200))
    assert step.rows[0].keep == 50  # the latest 50 of b's 110
    step.store("L0", torch.full((10, 1, 1), -1.), torch.zeros(10, 1, 1))
    held = step.rows[0].entry.layers["L0"][0].flatten().tolist()
    assert held == list(range(160, 200)) + [-1.0] * 10


def test_buffer_bytes_and_bad_capacity():
    assert buffer_bytes(capacity_tokens=8192, num_layers=24, num_kv_heads=2, head_size=64,
                        dtype_bytes=2) == 8192 * 24 * 2 * 64 * 2 * 2
    with pytest.raises(ValueError, match="capacity_tokens=0"):
        PromptKvBuffer(0)


@pytest.mark.parametrize("capacity, exact", [(1000, True), (100, False)])
def test_chunked_prefill_with_the_buffer_equals_one_step_prefill(capacity, exact):
    """A 300-token prompt prefilled in three steps of 100 through the Impl (quantize on write,
    attend): with room for the prompt, every prompt row equals attention over the unquantized
    prompt, as one-step ``exact`` prefill gives; with room for 100 tokens the third step reads
    positions 0-99 quantized, and its rows differ."""
    torch.manual_seed(4)
    layout = page_layout("kivi_4bit", D, N, torch.float32)
    cache = layout.allocate(num_blocks=4, num_kv_heads=H_KV)
    impl = KiviAttentionImpl(H_Q, D, D**-0.5, H_KV, None, None, "kivi_4bit")
    impl.model_dtype = torch.float32
    impl.knobs, impl.exact_prefill = KvQuantKnobs(prefill_kv="exact"), True
    pool = TailPool(["L0"], num_kv_heads=H_KV, key_group=64, head_size=D, dtype=torch.float32,
                    device="cpu", max_requests=1, entries_per_slot=1)
    buf = PromptKvBuffer(capacity)
    layer = types.SimpleNamespace(layer_name="L0")
    length = 300
    q, k, v = (torch.randn(length, h, D) for h in (H_Q, H_KV, H_KV))
    k[:, :, 5] *= 10  # an outlier key channel: quantized reads differ visibly
    table = torch.tensor([[3, 1, 0]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // N]) * N + p % N for p in range(length)])
    out = torch.zeros(length, H_Q, D)
    for lo in range(0, length, 100):
        hi = lo + 100
        qsl, seq_lens = torch.tensor([0, 100]), torch.tensor([hi])
        tail_mapping, tail_index = pool.step(["r"], {"r"}, qsl, seq_lens, 100)
        md = KiviAttentionMetadata(
            num_actual_tokens=100, max_query_len=100, max_seq_len=hi, query_start_loc=qsl,
            seq_lens=seq_lens, block_table=table, slot_mapping=slots[lo:hi], tail_pool=pool,
            tail_mapping=tail_mapping, tail_index=tail_index,
            prompt_kv=buf.plan(["r"], {"r"}, [0, 100], [hi], [length], MIN_ROWS))
        impl.write(layer, k[lo:hi], v[lo:hi], cache, slots[lo:hi], md)
        impl.forward(layer, q[lo:hi], k[lo:hi], v[lo:hi], cache, md, out[lo:hi])
    one_step = reference_attention(q, k, v)
    torch.testing.assert_close(out[:200], one_step[:200], atol=1e-4, rtol=1e-4)
    if exact:
        torch.testing.assert_close(out, one_step, atol=1e-4, rtol=1e-4)
    else:
        assert (out[200:] - one_step[200:]).abs().max() > 1e-2
    assert buf.held_tokens() == 0  # the prompt is complete
