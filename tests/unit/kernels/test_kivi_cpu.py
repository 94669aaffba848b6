"""The native CPU decode kernel (vllm_accel._C_kivi) against the torch reference path."""

from __future__ import annotations

import pytest
import torch

from vllm_accel.kernels.kivi_attention import kivi_paged_attention
from vllm_accel.kernels.kivi_cache import quantize_on_write, resolve_backend
from vllm_accel.kernels.kivi_cpu import HAS_NATIVE, decode_attention, native_problem
from vllm_accel.kernels.kivi_format import KiviLayout, hadamard_matrix

from .conftest import filled_kivi_cache

pytestmark = pytest.mark.skipif(not HAS_NATIVE, reason="vllm_accel._C_kivi is not built")


@pytest.mark.parametrize("bits_k, bits_v, value_group, residual, sinks", [
    (4, 4, None, "tail", 0), (2, 2, None, "tail", 0), (4, 2, 32, "tail", 0),
    (8, 4, None, "page", 0), (4, 4, 16, "page", 0), (4, 4, None, "tail", 8),
    (2, 2, 32, "page", 4),
])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (14, 2)])
def test_decode_matches_the_torch_path(bits_k, bits_v, value_group, residual, sinks, hq, hkv):
    layout = KiviLayout(bits_k, bits_v, head_size=64, block_size=128, key_group=64,
                        value_group=value_group, residual=residual, sink_tokens=sinks)
    seq_lens = [1, 5, 63, 64, 65, 128, 300, 257]
    cache, tail, table, tail_index = filled_kivi_cache(layout, seq_lens, hkv)
    q = torch.randn(len(seq_lens), hq, 64, dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    tail_args = ({"k_tail": tail, "tail_index": tail_index} if residual == "tail" else {})
    got = decode_attention(q, cache, table, lens, 0.125, layout, **tail_args)
    want = kivi_paged_attention(q, cache, table, lens, torch.arange(len(seq_lens) + 1),
                                0.125, layout, backend="torch", out=torch.zeros(
                                    q.shape, dtype=torch.float32), **tail_args)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("isa", ["", "avx2", "baseline"])
@pytest.mark.parametrize("head_size, key_group", [(64, 64), (128, 64), (96, 64), (64, 32)])
def test_every_compiled_copy_and_head_size_matches_the_torch_path(isa, head_size, key_group,
                                                                   monkeypatch):
    """The kernel has copies for D=64 and D=128 at key group 64 and a generic one, each compiled
    for AVX-512, AVX2 and the baseline; VLLM_ACCEL_KIVI_ISA caps the copy this CPU runs."""
    monkeypatch.setenv("VLLM_ACCEL_KIVI_ISA", isa)
    layout = KiviLayout(4, 4, head_size=head_size, block_size=128, key_group=key_group)
    seq_lens = [1, 40, 64, 65, 300]
    cache, tail, table, tail_index = filled_kivi_cache(layout, seq_lens, 2, seed=7)
    q = torch.randn(len(seq_lens), 6, head_size)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = decode_attention(q, cache, table, lens, head_size ** -0.5, layout, k_tail=tail,
                           tail_index=tail_index)
    want = kivi_paged_attention(q, cache, table, lens, torch.arange(len(seq_lens) + 1),
                                head_size ** -0.5, layout, k_tail=tail, tail_index=tail_index,
                                backend="torch", out=torch.zeros(q.shape, dtype=torch.float32))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("isa", ["", "baseline"])
@pytest.mark.parametrize("head_size", [64, 128, 32])
def test_rotated_values_come_back_in_the_value_space(isa, head_size, monkeypatch):
    """With value_rotation the kernel rotates each output row back itself (D=64 and D=128 have
    their own copies, D=32 runs the generic one)."""
    monkeypatch.setenv("VLLM_ACCEL_KIVI_ISA", isa)
    layout = KiviLayout(4, 4, head_size=head_size, block_size=128, key_group=64,
                        value_rotation="hadamard")
    seq_lens = [1, 64, 65, 300]
    cache, tail, table, tail_index = filled_kivi_cache(layout, seq_lens, 2, seed=3)
    q = torch.randn(len(seq_lens), 6, head_size)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = decode_attention(q, cache, table, lens, 0.1, layout, k_tail=tail,
                           tail_index=tail_index)
    want = kivi_paged_attention(q, cache, table, lens, torch.arange(len(seq_lens) + 1), 0.1,
                                layout, k_tail=tail, tail_index=tail_index, backend="torch",
                                out=torch.zeros(q.shape, dtype=torch.float32))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    unrotated = want @ hadamard_matrix(head_size)  # what the pages' space would give
    assert not torch.allclose(got, unrotated, atol=1e-2)


def test_threads_do_not_change_the_result():
    layout = KiviLayout(4, 4, head_size=64, block_size=128, key_group=64)
    cache, tail, table, tail_index = filled_kivi_cache(layout, [200, 70, 5], 2, seed=3)
    q = torch.randn(3, 4, 64)
    lens = torch.tensor([200, 70, 5])
    one = decode_attention(q, cache, table, lens, 0.1, layout, k_tail=tail,
                           tail_index=tail_index, num_threads=1)
    many = decode_attention(q, cache, table, lens, 0.1, layout, k_tail=tail,
                            tail_index=tail_index, num_threads=4)
    assert torch.equal(one, many)


def test_sink_rows_are_read_from_their_full_precision_copies():
    """Sink keys far outside the other keys' range (an attention sink): kept out of min/max and
    read exactly, so the native output matches attention over the unquantized sinks."""
    layout = KiviLayout(4, 4, head_size=64, block_size=128, key_group=64, sink_tokens=4,
                        dtype=torch.float32)
    assert native_problem(layout, torch.device("cpu")) is None
    cache, tail = layout.allocate(2, 1), layout.allocate_tail(1, 1)
    k, v = torch.randn(200, 1, 64), torch.randn(200, 1, 64)
    k[:4] *= 50
    v[:4] *= 50
    quantize_on_write(k, v, cache, torch.arange(200), layout, k_tail=tail,
                      tail_mapping=torch.zeros(200, dtype=torch.long), backend="native")
    q = k[:1].reshape(1, 1, 64) * 0.02  # reads the first sink most
    got = decode_attention(q, cache, torch.tensor([[0, 1]]), torch.tensor([200]), 0.125,
                           layout, k_tail=tail, tail_index=torch.tensor([0]))
    from vllm_accel.kernels.kivi_format import fake_quant_kv, reference_attention

    kq, vq = fake_quant_kv(k, v, layout)
    assert torch.equal(kq[:4], k[:4]) and torch.equal(vq[:4], v[:4])
    torch.testing.assert_close(got, reference_attention(q, kq, vq), atol=1e-4, rtol=1e-4)


def test_mixed_batch_sends_only_decode_rows_to_the_native_kernel():
    layout = KiviLayout(4, 4, head_size=64, block_size=128, key_group=64)
    seq_lens = [150, 90, 40]
    cache, tail, table, tail_index = filled_kivi_cache(layout, seq_lens, 2, seed=5)
    qsl = torch.tensor([0, 1, 31, 32])  # decode, a 30-token chunk, decode
    q = torch.randn(32, 6, 64)  # fp32: the chunk's split prefill runs in the query dtype
    lens = torch.tensor(seq_lens)
    run = lambda backend: kivi_paged_attention(  # noqa: E731
        q, cache, table, lens, qsl, 0.125, layout, k_tail=tail, tail_index=tail_index,
        backend=backend, out=torch.zeros(q.shape, dtype=torch.float32))
    native, ref = run("native"), run("torch")
    torch.testing.assert_close(native, ref, atol=1e-4, rtol=1e-4)
    assert resolve_backend("auto", torch.device("cpu"), layout) == "native"


@pytest.mark.parametrize("bits_k, bits_v, value_group, residual, sinks", [
    (4, 4, None, "tail", 0), (2, 2, None, "tail", 0), (4, 2, 16, "page", 0),
    (8, 8, None, "tail", 0), (4, 4, None, "tail", 8), (2, 4, 32, "page", 3),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_native_write_writes_the_bytes_of_the_torch_write(bits_k, bits_v, value_group,
                                                          residual, sinks, dtype):
    """Prefill chunks that complete groups from this call's tokens and from the tail, decode
    steps, padding and two sequences sharing a call: cache and tail bytes identical (sink
    copies and sink-free min/max included)."""
    layout = KiviLayout(bits_k, bits_v, head_size=64, block_size=128, key_group=32,
                        value_group=value_group, dtype=dtype, residual=residual,
                        sink_tokens=sinks)
    gen = torch.Generator().manual_seed(7)
    lengths = {0: 300, 1: 150}
    tables = {0: [3, 1, 6], 1: [2, 5]}
    caches = {b: layout.allocate(8, 2) for b in ("torch", "native")}
    tails = {b: layout.allocate_tail(4, 2) for b in ("torch", "native")}
    keys = {i: torch.randn(n, 2, 64, generator=gen) * 3 for i, n in lengths.items()}
    vals = {i: torch.randn(n, 2, 64, generator=gen) for i, n in lengths.items()}
    keys[0][:, :, 5] += 40.0  # an outlier channel
    done = {0: 0, 1: 0}
    for chunk in ((45, 20), (40, 60), (1, 1), (1, 1), (100, 0), (1, 68), (112, 0)):
        slot, entry, ks, vs = [], [], [], []
        for i, n in enumerate(chunk):
            pos = torch.arange(done[i], done[i] + n)
            slot.append(torch.tensor(tables[i])[pos // 128] * 128 + pos % 128)
            entry.append(2 * i + (pos // 32) % 2)
            ks.append(keys[i][pos])
            vs.append(vals[i][pos])
            done[i] += n
        slot.append(torch.full((2,), -1))  # padding
        entry.append(torch.zeros(2, dtype=torch.long))
        ks.append(torch.zeros(2, 2, 64))
        vs.append(torch.zeros(2, 2, 64))
        slot, entry, k, v = (torch.cat(x) for x in (slot, entry, ks, vs))
        for b in ("torch", "native"):
            tail_args = ({"k_tail": tails[b], "tail_mapping": entry}
                         if residual == "tail" else {})
            quantize_on_write(k, v, caches[b], slot, layout, backend=b, **tail_args)
    assert done == lengths
    assert torch.equal(caches["native"], caches["torch"])
    assert torch.equal(tails["native"], tails["torch"])


def test_pure_decode_batch_takes_the_direct_path():
    layout = KiviLayout(4, 4, head_size=64, block_size=128, key_group=64)
    seq_lens = [150, 64, 1]
    cache, tail, table, tail_index = filled_kivi_cache(layout, seq_lens, 2, seed=9)
    q = torch.randn(3, 4, 64, dtype=torch.bfloat16)
    run = lambda backend: kivi_paged_attention(  # noqa: E731
        q, cache, table, torch.tensor(seq_lens), torch.arange(4), 0.125, layout, k_tail=tail,
        tail_index=tail_index, backend=backend, max_query_len=1,
        out=torch.zeros(q.shape, dtype=torch.float32))
    torch.testing.assert_close(run("native"), run("torch"), atol=1e-4, rtol=1e-4)
