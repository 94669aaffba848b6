"""KIVI write path (quantize-on-write) and dequantization: torch reference and Triton."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_accel.kernels import kivi_cache  # noqa: E402
from vllm_accel.kernels.kivi_cache import (  # noqa: E402
    dequantize_pages,
    gather_sequence_kv,
    quantize_on_write,
    tail_entries,
)
from vllm_accel.kernels.kivi_format import KiviLayout, fake_quant_kv  # noqa: E402

needs_triton = pytest.mark.skipif(
    not (
        kivi_cache.HAS_TRITON
        and type(kivi_cache._kivi_write_keys_kernel).__name__ == "InterpretedFunction"
    ),
    reason="Triton missing, or imported before TRITON_INTERPRET=1 was set",
)


def _kv(seq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(seq, hkv, d, generator=g)
    k[:, :, 3] = k[:, :, 3] * 15 + 5  # outlier channel
    v = torch.randn(seq, hkv, d, generator=g)
    return k, v


def _slots(block_row, positions, n):
    return block_row[positions // n].long() * n + positions % n


def _write_sequence(
    lay, k, v, cache, tail, block_row, chunks, entry_of_pos, backend="torch", start=0
):
    """Write positions start.. of one sequence in chunks of the given sizes."""
    pos = start
    for c in chunks:
        p = torch.arange(pos, pos + c)
        tm = None if tail is None else entry_of_pos(p)
        quantize_on_write(
            k[p],
            v[p],
            cache,
            _slots(block_row, p, lay.block_size),
            lay,
            k_tail=tail,
            tail_mapping=tm,
            backend=backend,
        )
        pos += c
    return pos


def _fresh(lay, num_blocks, hkv, entries=2):
    cache = lay.allocate(num_blocks, hkv)
    tail = lay.allocate_tail(entries, hkv) if lay.residual == "tail" else None
    return cache, tail


LAYOUTS = [
    KiviLayout(4, 4, 32, 32, 16, 16, torch.bfloat16, 0, "tail"),
    KiviLayout(2, 4, 32, 32, 16, 32, torch.float16, 3, "page"),
    KiviLayout(4, 2, 32, 64, 32, 16, torch.bfloat16, 2, "tail"),
    KiviLayout(4, 4, 32, 32, 16, 16, torch.float32, 0, "page"),  # float32 models
]


@pytest.mark.parametrize(
    "lay", LAYOUTS, ids=lambda lay: f"K{lay.bits_k}V{lay.bits_v}-{lay.residual}-S{lay.sink_tokens}"
)
def test_prefill_chunked_and_decode_write_the_same_bytes(lay):
    hkv, L = 2, 83
    k, v = _kv(L, hkv, lay.head_size)
    row = torch.tensor([4, 1, 6, 2])
    one_entry = lambda p: torch.ones_like(p)  # noqa: E731
    results = []
    for chunks in ([L], [7, 20, 1, 30] + [1] * 25, [1] * L):
        cache, tail = _fresh(lay, 8, hkv)
        _write_sequence(lay, k, v, cache, tail, row, chunks, one_entry)
        results.append((cache, tail))
    for cache, tail in results[1:]:
        assert torch.equal(cache, results[0][0])
        if tail is not None:
            assert torch.equal(tail, results[0][1])
    # what attention reads is exactly the fake-quantized sequence
    cache, tail = results[0]
    kk, vv = gather_sequence_kv(cache, row, L, lay, k_tail=tail, tail_entry=1)
    fk, fv = fake_quant_kv(k, v, lay)
    assert torch.equal(kk, fk) and torch.equal(vv, fv)


def test_many_sequences_in_one_call_with_padding():
    lay = KiviLayout(4, 4, 32, 32, 16, 32, torch.bfloat16)
    hkv = 2
    lens = [40, 17, 5]
    seqs = [_kv(n, hkv, 32, seed=i) for i, n in enumerate(lens)]
    rows = [torch.tensor([0, 3]), torch.tensor([5]), torch.tensor([2])]
    # reference: each sequence on its own, token by token
    ref_cache, ref_tail = _fresh(lay, 6, hkv, entries=3)
    for i, (k, v) in enumerate(seqs):
        _write_sequence(
            lay,
            k,
            v,
            ref_cache,
            ref_tail,
            rows[i],
            [1] * lens[i],
            lambda p, i=i: torch.full_like(p, i),
        )
    # batched: step 1 = prefill chunks of all sequences + padding; step 2 = the remaining tokens
    cache, tail = _fresh(lay, 6, hkv, entries=3)
    split = [31, 15, 5]
    for lo_hi in ([(0, s) for s in split], [(s, n) for s, n in zip(split, lens)]):
        ks, vs, sl, tm = [], [], [], []
        for i, (lo, hi) in enumerate(lo_hi):
            p = torch.arange(lo, hi)
            ks.append(seqs[i][0][p]), vs.append(seqs[i][1][p])
            sl.append(_slots(rows[i], p, 32)), tm.append(torch.full_like(p, i))
        pad = torch.zeros(3, hkv, 32)
        quantize_on_write(
            torch.cat(ks + [pad]),
            torch.cat(vs + [pad]),
            cache,
            torch.cat(sl + [torch.full((3,), -1)]),
            lay,
            k_tail=tail,
            tail_mapping=torch.cat(tm + [torch.zeros(3, dtype=torch.long)]),
        )
    assert torch.equal(cache, ref_cache) and torch.equal(tail, ref_tail)


def test_tail_entries_alternate_per_group_or_use_one_entry_per_slot():
    # seq 0: decode at position 40; seq 1: prefill positions 0..4; seq 2: chunk 14..17 (G=16)
    qsl = torch.tensor([0, 1, 6, 10])
    seq_lens = torch.tensor([41, 5, 18])
    slots = torch.tensor([3, 0, 1])
    tm, ti = tail_entries(qsl, seq_lens, 16, request_slots=slots)
    assert tm.tolist() == [6 + 0, 0, 0, 0, 0, 0, 2, 2, 3, 3]
    assert ti.tolist() == [6 + 0, 0, 2 + 1]
    tm, ti = tail_entries(qsl, seq_lens, 16, request_slots=slots, entries_per_slot=1)
    assert tm.tolist() == [3, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert ti.tolist() == [3, 0, 1]


def test_rollback_across_a_group_boundary_with_two_tail_entries_per_slot():
    """Speculative decoding: drafts that complete a group are rejected and rewritten."""
    lay = KiviLayout(4, 4, 32, 32, 16, 32, torch.bfloat16)
    hkv, L = 1, 21
    k, v = _kv(L, hkv, 32)
    row = torch.tensor([0])
    parity = lambda p: (p // lay.key_group) % 2  # noqa: E731
    clean, clean_tail = _fresh(lay, 1, hkv)
    _write_sequence(lay, k, v, clean, clean_tail, row, [L], parity)
    cache, tail = _fresh(lay, 1, hkv)
    _write_sequence(lay, k, v, cache, tail, row, [14], parity)
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[15:] += 3.0
    bad_v[15:] -= 2.0
    _write_sequence(
        lay, bad_k, bad_v, cache, tail, row, [6], parity, start=14
    )  # 14..19, 15.. wrong
    _write_sequence(lay, k, v, cache, tail, row, [6], parity, start=15)  # rewrite 15..20
    ka, va = gather_sequence_kv(cache, row, L, lay, k_tail=tail, tail_entry=1)
    kb, vb = gather_sequence_kv(clean, row, L, lay, k_tail=clean_tail, tail_entry=1)
    assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_roundtrip_error_is_within_half_a_quantization_step():
    lay = KiviLayout(4, 4, 64, 64, 32, 64, torch.bfloat16)
    k, v = _kv(64, 2, 64)
    cache, tail = _fresh(lay, 1, 2)
    quantize_on_write(
        k,
        v,
        cache,
        torch.arange(64),
        lay,
        k_tail=tail,
        tail_mapping=torch.zeros(64, dtype=torch.long),
    )
    kd, vd = dequantize_pages(cache, torch.tensor([0]), lay)
    views = lay.views(cache)
    kb, vb = k.bfloat16().float(), v.bfloat16().float()
    k_step = views.k_scale[0].float().repeat_interleave(32, 1).transpose(0, 1)  # [N, H, D]
    v_step = views.v_scale[0].float().transpose(0, 1)  # [N, H, 1]
    slack = 1e-3 * (kb.abs().amax() + 1)
    assert bool(((kd[0].transpose(0, 1) - kb).abs() <= 0.5 * k_step + slack).all())
    assert bool(
        ((vd[0].transpose(0, 1) - vb).abs() <= 0.5 * v_step + 1e-3 * (vb.abs().amax() + 1)).all()
    )
    # the outlier channel does not widen the other channels' steps
    assert float(views.k_scale[0, :, :, 3].float().min()) > 5 * float(
        views.k_scale[0, :, :, 4:].float().max()
    )


def test_argument_errors():
    lay = KiviLayout(4, 4, 32, 32, 16)
    cache = lay.allocate(2, 1)
    k = torch.zeros(2, 1, 32)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="needs k_tail"):
        quantize_on_write(k, k, cache, slots, lay)
    with pytest.raises(ValueError, match="needs tail_mapping"):
        quantize_on_write(k, k, cache, slots, lay, k_tail=lay.allocate_tail(1, 1))
    with pytest.raises(ValueError, match="k_tail dtype"):
        quantize_on_write(
            k, k, cache, slots, lay, k_tail=torch.zeros(1, 1, 16, 32), tail_mapping=slots
        )
    with pytest.raises(ValueError, match="shape"):
        quantize_on_write(torch.zeros(2, 2, 32), torch.zeros(2, 2, 32), cache, slots, lay)
    with pytest.raises(ValueError, match="backend"):
        quantize_on_write(
            k,
            k,
            cache,
            slots,
            lay,
            k_tail=lay.allocate_tail(1, 1),
            tail_mapping=slots,
            backend="cuda",
        )
    page_lay = KiviLayout(4, 4, 32, 32, 16, residual="page")
    with pytest.raises(ValueError, match="k_tail must be None"):
        quantize_on_write(
            k, k, page_lay.allocate(2, 1), slots, page_lay, k_tail=lay.allocate_tail(1, 1)
        )


# ---------------------------------------------------------------------------- Triton vs torch
TRITON_LAYOUTS = [
    KiviLayout(4, 2, 32, 32, 16, 16, torch.bfloat16, 0, "tail"),
    KiviLayout(2, 4, 48, 32, 16, None, torch.float16, 3, "page"),  # D=48: padded to 64 lanes
    KiviLayout(4, 4, 32, 32, 16, 16, torch.float32, 0, "tail"),
]


@needs_triton
@pytest.mark.parametrize(
    "lay",
    TRITON_LAYOUTS,
    ids=lambda lay: f"K{lay.bits_k}V{lay.bits_v}-D{lay.head_size}-{lay.residual}",
)
def test_triton_write_and_dequantize_match_torch(lay):
    hkv, L = 2, 36
    k, v = _kv(L, hkv, lay.head_size)
    row = torch.tensor([2, 0])
    entry = lambda p: (p // lay.key_group) % 2  # noqa: E731
    chunks = [
        29,
        1,
        1,
        1,
        4,
    ]  # prefill, then decode steps; token 31 completes a group from the tail
    out = {}
    for backend in ("torch", "triton"):
        cache, tail = _fresh(lay, 3, hkv)
        _write_sequence(lay, k, v, cache, tail, row, chunks, entry, backend=backend)
        out[backend] = (cache, tail)
    assert torch.equal(out["triton"][0], out["torch"][0])
    if lay.residual == "tail":
        assert torch.equal(out["triton"][1], out["torch"][1])
    cache = out["torch"][0]
    pages = torch.tensor([0, 2])
    kt, vt = dequantize_pages(cache, pages, lay, backend="triton")
    kr, vr = dequantize_pages(cache, pages, lay, backend="torch")
    assert torch.equal(kt, kr) and torch.equal(vt, vr)
