"""Block-sparse attention: layout helpers, torch reference, CPU torch path, Triton kernel.

Triton runs in the interpreter (see conftest); shapes are small to keep the folder fast.
"""

from __future__ import annotations

import doctest

import pytest
import torch

from vllm_accel.kernels import block_sparse_attention as bsa
from vllm_accel.kernels.block_sparse_attention import (
    BlockSelection,
    QueryBlocks,
    block_sparse_attention,
    block_sparse_attention_contiguous,
    block_sparse_attention_reference,
)

from .conftest import dense_causal_attention, make_paged_batch, requires_triton_interpreter

# (seq_lens, query_lens): one full prefill, a chunk after an unaligned context, a short chunk
VARLEN = ([100, 150, 67], [100, 77, 20])


def _random_selection(qb: QueryBlocks, key_block: int, num_heads: int, p: float, seed: int):
    """Random block mask that always keeps the diagonal blocks (no empty query rows)."""
    g = torch.Generator().manual_seed(seed)
    nkb = max(-(-n // key_block) for n in qb.seq_lens)
    mask = torch.rand(qb.num_blocks, num_heads, nkb, generator=g) < p
    kb = torch.arange(nkb)
    diag = (kb[None, :] >= (qb.first_pos // key_block)[:, None]) & (
        kb[None, :] <= (qb.last_pos // key_block)[:, None]
    )
    return BlockSelection.from_mask(mask | diag[:, None, :], qb, key_block)


def _run(batch, sel, backend):
    return block_sparse_attention(
        batch.query, batch.k_cache, batch.v_cache, sel, batch.block_table, batch.seq_lens,
        batch.query_start_loc, backend=backend,
    )


def test_doctests():
    assert doctest.testmod(bsa).failed == 0


def test_query_blocks_are_aligned_to_absolute_positions():
    qb = QueryBlocks.build(torch.tensor([100, 150]), torch.tensor([0, 100, 177]), 32)
    # seq 0: positions 0..99 -> blocks 0..3; seq 1: context 73, positions 73..149 -> blocks 2..4
    assert qb.seq.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert qb.index.tolist() == [0, 1, 2, 3, 2, 3, 4]
    assert qb.first_pos.tolist() == [0, 32, 64, 96, 73, 96, 128]
    assert qb.last_pos.tolist() == [31, 63, 95, 99, 95, 127, 149]
    assert qb.seq_block_offsets == (0, 4, 7)


def test_selection_from_mask_compacts_and_splits_offband():
    qb = QueryBlocks.build(torch.tensor([96]), torch.tensor([0, 40]), 32)  # context 56
    # query blocks 1 (positions 56..63) and 2 (64..95); key blocks of 16
    mask = torch.zeros(2, 1, 6, dtype=torch.bool)
    mask[0, 0, [0, 2, 3, 5]] = True  # block 5 is beyond the causal limit of query block 1
    mask[1, 0, [1, 4, 5]] = True
    sel = BlockSelection.from_mask(mask, qb, 16)
    assert sel.block_counts.tolist() == [[3], [3]]
    assert sel.block_indices[0, 0].tolist() == [0, 2, 3]
    assert sel.block_indices[1, 0].tolist() == [1, 4, 5]
    # diagonal starts at key block 56 // 16 = 3 and 64 // 16 = 4
    assert sel.num_offband.tolist() == [[2], [1]]
    assert torch.equal(sel.to_mask(6)[0, 0], torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool))
    assert sel.density() == pytest.approx(6 / (4 + 6))


def test_kv_cache_views_of_cpu_and_cuda_layouts():
    nb, H, P, D = 3, 2, 4, 8
    cpu = torch.arange(nb * H * P * 2 * D, dtype=torch.float32).view(nb, H, P, 2 * D)
    rows = cpu.view(nb, H, 2 * P, D)
    k, v = bsa.kv_cache_views_cpu(cpu, isa="plain")
    assert k.shape == (nb, P, H, D)
    assert torch.equal(k[1, 2, 1], rows[1, 1, 2]) and torch.equal(v[1, 2, 1], rows[1, 1, P + 2])
    k, v = bsa.kv_cache_views_cpu(cpu, isa="vec")  # K tile stored as [D, P]
    k_tile = rows[1, 1, :P].reshape(-1).view(D, P)
    assert torch.equal(k[1, 2, 1], k_tile[:, 2]) and torch.equal(v[1, 2, 1], rows[1, 1, P + 2])
    cuda_like = torch.randn(nb, P, H, 2 * D).transpose(1, 2)  # logical [nb, H, P, 2D]
    k, v = bsa.kv_cache_views_split_last_dim(cuda_like)
    assert torch.equal(k[2, 3, 1], cuda_like[2, 1, 3, :D])
    assert torch.equal(v[2, 3, 1], cuda_like[2, 1, 3, D:])
    with pytest.raises(NotImplementedError):
        bsa.kv_cache_views_cpu(cpu, isa="neon")


def _pack_amx(keys, values, page_size):
    """Pack plain ``[P, D]`` tiles the way vLLM's AMX ``reshape_and_cache`` lays them out."""
    P, D = page_size, keys.shape[-1]
    k_tile = torch.empty(P * D, dtype=keys.dtype)
    v_tile = torch.empty(P * D, dtype=values.dtype)
    for t in range(P):
        for d in range(D):
            k_tile[(t // 16) * 16 * D + (d // 2) * 32 + (t % 16) * 2 + d % 2] = keys[t, d]
            v_tile[(d // 16) * 16 * P + (t // 2) * 32 + (d % 16) * 2 + t % 2] = values[t, d]
    return k_tile, v_tile


def test_amx_packed_pages_unpack_on_gather():
    nb, H, P, D = 3, 2, 32, 32
    g = torch.Generator().manual_seed(0)
    plain_k = torch.randn(nb, H, P, D, generator=g)
    plain_v = torch.randn(nb, H, P, D, generator=g)
    cache = torch.zeros(nb, H, P, 2 * D)
    flat = cache.view(nb, H, 2, P * D)
    for p in range(nb):
        for h in range(H):
            flat[p, h, 0], flat[p, h, 1] = _pack_amx(plain_k[p, h], plain_v[p, h], P)
    k, v = bsa.kv_cache_views_cpu(cache, isa="amx")
    assert isinstance(k, bsa.PackedKVPages) and k.shape == (nb, P, H, D)
    pages = torch.tensor([2, 0])
    assert torch.equal(k.index_select(0, pages), plain_k[pages].transpose(1, 2))
    assert torch.equal(v.index_select(0, pages), plain_v[pages].transpose(1, 2))
    seq = bsa.gather_sequence_kv(k, torch.tensor([1, 2]), 40)
    assert torch.equal(seq, torch.cat([plain_k[1], plain_k[2]], dim=1)[:, :40])


def test_cpu_layout_matches_vllm_writer_and_attention_runs_on_it():
    try:
        from vllm import _custom_ops as ops

        ops.cpu_attn_reshape_and_cache  # noqa: B018
    except Exception:
        pytest.skip("vLLM CPU ops not available")
    nb, H, P, D, n = 4, 2, 32, 64, 100
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
    cache = torch.zeros(nb, H, P, 2 * D)
    key_tiles, value_tiles = cache.view(nb, H, 2 * P, D).chunk(2, dim=2)
    block_table = torch.tensor([[3, 0, 2, 1]], dtype=torch.int32)
    slots = (block_table[0].long()[torch.arange(n) // P] * P + torch.arange(n) % P)
    ops.cpu_attn_reshape_and_cache(key, value, key_tiles, value_tiles, slots, "vec")
    k_cache, v_cache = bsa.kv_cache_views_cpu(cache, isa="vec")
    assert torch.equal(bsa.gather_sequence_kv(k_cache, block_table[0], n), key.transpose(0, 1))
    assert torch.equal(bsa.gather_sequence_kv(v_cache, block_table[0], n), value.transpose(0, 1))
    q = torch.randn(n, 4, D, generator=g)
    loc, seq_lens = torch.tensor([0, n]), torch.tensor([n])
    sel = BlockSelection.all_causal(QueryBlocks.build(seq_lens, loc, 32), 32, H)
    out = block_sparse_attention(q, k_cache, v_cache, sel, block_table, seq_lens, loc)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), is_causal=True,
        enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["cpu", "kv_last"])
def test_reference_with_all_blocks_equals_dense(layout):
    batch = make_paged_batch(*VARLEN, layout=layout, page_size=16)
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, 32)
    sel = BlockSelection.all_causal(qb, 32, 2)
    out = block_sparse_attention_reference(
        batch.query, batch.k_cache, batch.v_cache, sel, batch.block_table, batch.seq_lens,
        batch.query_start_loc,
    )
    torch.testing.assert_close(out, dense_causal_attention(batch), atol=1e-5, rtol=1e-5)


def test_reference_drops_unselected_blocks():
    # one sequence; select only the diagonal: each query sees keys of its own key block only
    batch = make_paged_batch([64], [64], num_q_heads=2, num_kv_heads=2, page_size=64)
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, 16)
    mask = torch.eye(4, dtype=torch.bool)[:, None, :].expand(4, 2, 4)
    sel = BlockSelection.from_mask(mask, qb, 16)
    out = block_sparse_attention_reference(
        batch.query, batch.k_cache, batch.v_cache, sel, batch.block_table, batch.seq_lens,
        batch.query_start_loc,
    )
    q = batch.query[16:32].transpose(0, 1)
    k, v = batch.keys[0][16:32].transpose(0, 1), batch.values[0][16:32].transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out[16:32], ref.transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_query_head", [False, True])
@pytest.mark.parametrize("blocks", [(32, 16), (64, 32)])
def test_torch_path_matches_reference(per_query_head, blocks):
    bq, bk = blocks
    batch = make_paged_batch(*VARLEN, layout="cpu", page_size=32)
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, bq)
    sel = _random_selection(qb, bk, 4 if per_query_head else 2, p=0.4, seed=1)
    ref = _run(batch, sel, "reference")
    torch.testing.assert_close(_run(batch, sel, "torch"), ref, atol=2e-5, rtol=1e-5)


def test_torch_path_all_blocks_equals_dense_and_empty_rows_are_zero():
    batch = make_paged_batch(*VARLEN, page_size=16)
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, 64)
    out = _run(batch, BlockSelection.all_causal(qb, 16, 2), "torch")
    torch.testing.assert_close(out, dense_causal_attention(batch), atol=2e-5, rtol=1e-5)
    nothing = BlockSelection.from_mask(torch.zeros(qb.num_blocks, 2, 10, dtype=torch.bool), qb, 16)
    assert torch.count_nonzero(_run(batch, nothing, "torch")) == 0


def test_torch_path_bf16():
    batch = make_paged_batch(*VARLEN, page_size=32, dtype=torch.bfloat16)
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, 32)
    sel = _random_selection(qb, 32, 2, p=0.5, seed=2)
    out = _run(batch, sel, "torch")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _run(batch, sel, "reference").float(),
                               atol=3e-2, rtol=3e-2)


def test_contiguous_torch_matches_paged():
    batch = make_paged_batch(*VARLEN, page_size=16)
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, 32)
    sel = _random_selection(qb, 32, 2, p=0.5, seed=3)
    out = block_sparse_attention_contiguous(
        batch.query, batch.k_flat, batch.v_flat, sel, batch.query_start_loc, batch.kv_start_loc,
        backend="torch",
    )
    torch.testing.assert_close(out, _run(batch, sel, "reference"), atol=2e-5, rtol=1e-5)


def test_auto_backend_on_cpu_is_torch():
    assert bsa._choose_backend("auto", torch.zeros(1)) == "torch"
    with pytest.raises(ValueError):
        bsa._choose_backend("cuda-magic", torch.zeros(1))


# ---------------------------------------------------------------------- Triton (interpreter)

# page 32 holds two key blocks of 16 (one page id per block); page 8 makes a key block of 16
# span two pages (one page id per key)
@requires_triton_interpreter
@pytest.mark.parametrize("layout,page_size", [("cpu", 32), ("kv_last", 8)])
def test_triton_all_blocks_equals_dense(layout, page_size):
    batch = make_paged_batch(*VARLEN, layout=layout, page_size=page_size)
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, 32)
    out = _run(batch, BlockSelection.all_causal(qb, 16, 2), "triton")
    torch.testing.assert_close(out, dense_causal_attention(batch), atol=1e-5, rtol=1e-5)


@requires_triton_interpreter
@pytest.mark.parametrize("per_query_head", [False, True])
def test_triton_matches_reference_random_selection(per_query_head):
    batch = make_paged_batch(*VARLEN, layout="cpu", page_size=32)
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, 16)
    sel = _random_selection(qb, 16, 4 if per_query_head else 2, p=0.3, seed=4)
    ref = _run(batch, sel, "reference")
    torch.testing.assert_close(_run(batch, sel, "triton"), ref, atol=1e-5, rtol=1e-5)


@requires_triton_interpreter
def test_triton_contiguous_and_odd_head_dim():
    # head_dim 24 is padded to 32 inside the kernel; 3 query heads per KV head
    batch = make_paged_batch([90, 40], [90, 25], num_q_heads=3, num_kv_heads=1, head_dim=24)
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, 32)
    sel = _random_selection(qb, 16, 1, p=0.5, seed=5)
    out = block_sparse_attention_contiguous(
        batch.query, batch.k_flat, batch.v_flat, sel, batch.query_start_loc, batch.kv_start_loc,
        backend="triton",
    )
    torch.testing.assert_close(out, _run(batch, sel, "reference"), atol=1e-5, rtol=1e-5)


@requires_triton_interpreter
def test_triton_rows_without_keys_are_zero():
    batch = make_paged_batch([48], [48], num_q_heads=2, num_kv_heads=2)
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, 16)
    mask = torch.zeros(qb.num_blocks, 2, 3, dtype=torch.bool)
    mask[:, 0, 0] = True  # head 0 sees the sink block, head 1 sees nothing
    sel = BlockSelection.from_mask(mask, qb, 16)
    out = _run(batch, sel, "triton")
    assert torch.isfinite(out).all()
    assert torch.count_nonzero(out[:, 1]) == 0
    torch.testing.assert_close(out, _run(batch, sel, "reference"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_lens,query_lens", [([100, 150, 67], [100, 77, 20]), ([256], [256])])
def test_torch_path_handles_partial_diagonals_and_ragged_heads(seq_lens, query_lens):
    # the diagonal region of some query blocks is only partly selected (masked fallback), and
    # heads select different numbers of blocks (ragged runs merged by log-sum-exp)
    batch = make_paged_batch(seq_lens, query_lens, page_size=32, seed=6)
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, 64)
    g = torch.Generator().manual_seed(7)
    mask = torch.rand(qb.num_blocks, 2, 16, generator=g) < 0.5
    mask[:, :, 0] = True  # every row sees the sink
    mask[::2, 1] = False  # even query blocks: head 1 sees only ...
    mask[::2, 1, 0] = True  # ... the sink
    sel = BlockSelection.from_mask(mask, qb, 16)
    torch.testing.assert_close(_run(batch, sel, "torch"), _run(batch, sel, "reference"),
                               atol=2e-5, rtol=1e-5)


def test_torch_path_wide_uniform_runs_take_the_two_call_path(monkeypatch):
    monkeypatch.setattr(bsa, "_MAX_ONE_CALL_KEYS", 32)  # 2 key blocks of 16
    batch = make_paged_batch([200], [200], page_size=32, seed=9)
    qb = QueryBlocks.build(batch.seq_lens, batch.query_start_loc, 32)
    sel = BlockSelection.all_causal(qb, 16, 2)
    torch.testing.assert_close(_run(batch, sel, "torch"), dense_causal_attention(batch),
                               atol=2e-5, rtol=1e-5)
