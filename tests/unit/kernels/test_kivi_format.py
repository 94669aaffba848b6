"""KIVI page layout, capacity arithmetic, packing and fake quantization (torch only)."""

import pytest
import torch

from vllm_accel.kernels.kivi_format import (
    KiviLayout,
    attention_error,
    dequantize_codes,
    fake_quant_kv,
    fake_quant_per_token,
    hadamard_matrix,
    pack_codes,
    quantize_groups,
    rotate_values,
    unpack_codes,
)


# ------------------------------------------------------------------------------ capacity
@pytest.mark.parametrize(
    "name,d,bytes_per_token,ratio",
    [
        ("kivi_4bit", 64, 72, 256 / 72),
        ("kivi_4bit", 128, 140, 512 / 140),
        ("kivi_2bit", 64, 40, 256 / 40),
        ("kivi_2bit", 128, 76, 512 / 76),
        ("kivi_k4v2", 64, 64, 4.0),
        ("kivi_k4v2", 128, 124, 512 / 124),
    ],
)
def test_preset_capacity(name, d, bytes_per_token, ratio):
    lay = KiviLayout.preset(name, head_size=d, block_size=128)
    assert lay.bytes_per_token_head == bytes_per_token
    assert lay.page_bytes == 128 * bytes_per_token
    assert lay.capacity_ratio_vs_bf16 == pytest.approx(ratio)


def test_capacity_targets_and_why_64_token_key_groups():
    for d in (64, 128):
        assert KiviLayout.preset("kivi_4bit", d).capacity_ratio_vs_bf16 >= 3.5
        assert KiviLayout.preset("kivi_2bit", d).capacity_ratio_vs_bf16 >= 6.0
    # fp16 scale+zero per 32-token key group: 4-bit misses 3.5x (measurements.md: 3.4x)
    assert KiviLayout(4, 4, 128, 128, key_group=32).capacity_ratio_vs_bf16 < 3.5
    # codes + scales: D/2 + D/2 + 4D/G + 4D/VG bytes
    lay = KiviLayout(4, 4, 128, 128, key_group=64, value_group=128)
    assert lay.bytes_per_token_head == 64 + 64 + 4 * 128 // 64 + 4 * 128 // 128


def test_residual_in_page_costs_capacity_and_tail_is_per_sequence():
    tail = KiviLayout.preset("kivi_4bit", 128)
    page = KiviLayout.preset("kivi_4bit", 128, residual="page")
    assert page.bytes_per_token_head == tail.bytes_per_token_head + 2 * 64 * 128 // 128
    assert page.capacity_ratio_vs_bf16 < 2.0
    assert tail.tail_entry_bytes == 64 * 128 * 2 and page.tail_entry_bytes == 0
    # two tail entries per sequence cost 4 B/token at 8K tokens
    assert tail.bytes_per_token_head_at(8192) == pytest.approx(140 + 4)
    sinks = KiviLayout.preset("kivi_4bit", 128, sink_tokens=4)
    assert sinks.bytes_per_token_head == 140 + 4 * 128 * 2 * 2 // 128


def test_regions_are_aligned_disjoint_and_inside_the_page():
    lay = KiviLayout(2, 4, 96, 64, 32, 48, torch.float16, sink_tokens=3, residual="page")
    regs = sorted(lay.regions.values(), key=lambda r: r.offset)
    for a, b in zip(regs, regs[1:]):
        assert a.offset + a.nbytes <= b.offset
    assert all(r.offset % 16 == 0 for r in regs)
    assert regs[-1].offset + regs[-1].nbytes <= lay.page_bytes
    assert set(lay.regions) == {
        "k_codes",
        "v_codes",
        "k_scale",
        "k_zero",
        "v_scale",
        "v_zero",
        "sink_k",
        "sink_v",
        "residual_k",
    }


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(bits_k=3), "bits_k"),
        (dict(bits_v=1), "bits_v"),
        (dict(head_size=100), "head_size"),
        (dict(key_group=48), "key_group"),
        (dict(block_size=96, key_group=64), "block_size"),
        (dict(value_group=24), "value_group"),
        (dict(dtype=torch.float64), "dtype"),
        (dict(sink_tokens=64, key_group=64), "sink_tokens"),
        (dict(residual="ring"), "residual"),
        (dict(value_rotation="random"), "value_rotation"),
        (dict(head_size=96, value_rotation="hadamard"), "value_rotation"),
    ],
)
def test_validation_names_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=f"invalid {name}=.*allowed"):
        KiviLayout(**kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown name"):
        KiviLayout.preset("kivi_3bit", 128)


# ------------------------------------------------------------------------------ cache views
def test_views_alias_the_cache_and_reject_bad_caches():
    lay = KiviLayout(4, 4, 64, 32, 16, sink_tokens=2, residual="page")
    cache = lay.allocate(3, 2)
    assert cache.shape == (3, 2, 32, lay.bytes_per_token_head)
    v = lay.views(cache)
    assert v.k_codes.shape == (3, 2, 32, 32) and v.k_scale.shape == (3, 2, 2, 64)
    assert v.v_scale.shape == (3, 2, 32, 1) and v.residual_k.shape == (3, 2, 16, 64)
    v.k_scale[1, 1, 0, 3] = 2.5
    reg = lay.regions["k_scale"]
    raw = lay.page_view(cache)[1, 1, reg.offset + 6 : reg.offset + 8].view(torch.float16)
    assert float(raw) == 2.5
    with pytest.raises(ValueError, match="dtype"):
        lay.views(cache.view(torch.int8))
    with pytest.raises(ValueError, match="shape"):
        lay.views(torch.zeros(3, 2, 32, 7, dtype=torch.uint8))
    nhd = torch.zeros(3, 32, 2, lay.bytes_per_token_head, dtype=torch.uint8).transpose(1, 2)
    with pytest.raises(ValueError, match="strides"):
        lay.views(nhd)


# ------------------------------------------------------------------------------ primitives
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    codes = torch.randint(0, 1 << bits, (5, 3, 32), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, 3, 32 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)
    if bits == 4:  # lowest channel in the lowest bits
        assert int(packed[0, 0, 0]) == int(codes[0, 0, 0]) | (int(codes[0, 0, 1]) << 4)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_roundtrip_error_bound(bits):
    torch.manual_seed(0)
    x = torch.randn(64, 8, 16) * torch.linspace(0.1, 30, 16)
    codes, scale, zero = quantize_groups(x, bits, dim=0)
    assert scale.dtype == torch.float16 and scale.shape == (1, 8, 16)
    assert int(codes.max()) <= (1 << bits) - 1
    err = (dequantize_codes(codes, scale, zero) - x).abs()
    # half a step, plus the fp16 rounding of zero and scale (relative 2^-11) at the range ends
    rng = x.amax(0, keepdim=True) - x.amin(0, keepdim=True)
    bound = 0.5 * scale.float() + 2e-3 * (rng + x.abs().amax(0, keepdim=True))
    assert bool((err <= bound).all())


def test_quantize_constant_group_and_exclusion():
    x = torch.full((16, 4), 3.0)
    codes, scale, zero = quantize_groups(x, 4, dim=0)
    assert torch.equal(dequantize_codes(codes, scale, zero), x)
    y = torch.randn(16, 4)
    y[0] = 1000.0  # an excluded outlier row must not widen the range
    excl = torch.zeros(16, 1, dtype=torch.bool)
    excl[0] = True
    _, s_ex, _ = quantize_groups(y, 4, dim=0, exclude=excl)
    _, s_in, _ = quantize_groups(y, 4, dim=0)
    assert bool((s_ex.float() < 1.0).all()) and bool((s_in.float() > 50).all())


# ------------------------------------------------------------------------------ fake quant
def _outlier_kv(seq=256, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(seq, hkv, d, generator=g)
    k[:, :, 5] = k[:, :, 5] * 20 + 10  # an outlier key channel (slow RoPE channels in Qwen)
    v = torch.randn(seq, hkv, d, generator=g)
    q = torch.randn(seq, 4 * hkv, d, generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def test_fake_quant_residual_and_sinks_are_exact():
    _, k, v = _outlier_kv(seq=100)
    lay = KiviLayout(4, 4, 64, 32, 16, sink_tokens=2)
    kq, vq = fake_quant_kv(k, v, lay)
    assert torch.equal(kq[96:], k[96:].float())  # unfinished key group: full precision
    assert not torch.equal(vq[96:], v[96:].float())  # values are quantized at once
    for p0 in (0, 32, 64):  # first 2 slots of every page
        assert torch.equal(kq[p0 : p0 + 2], k[p0 : p0 + 2].float())
        assert torch.equal(vq[p0 : p0 + 2], v[p0 : p0 + 2].float())
    assert not torch.equal(kq[2:16], k[2:16].float())


def test_per_channel_keys_beat_per_token_keys_with_an_outlier_channel():
    q, k, v = _outlier_kv()
    chan = attention_error(q, k, v, "kivi_4bit", block_size=64)
    tok = attention_error(q, k, v, "kivi_4bit", key_mode="token", block_size=64)
    int4 = attention_error(q, k, v, "int4_per_token")
    int8 = attention_error(q, k, v, "int8_per_token")
    assert chan["out_rel"] < 0.5 * tok["out_rel"]
    assert chan["out_rel"] < 0.5 * int4["out_rel"]
    assert int8["out_rel"] < chan["out_rel"]
    assert chan["k_rel"] < tok["k_rel"]
    assert chan["v_rel"] == pytest.approx(tok["v_rel"])  # only the key axis differs
    two = attention_error(q, k, v, "kivi_2bit", block_size=64)
    assert two["out_rel"] > chan["out_rel"]


def test_hadamard_is_orthogonal_symmetric_and_refuses_other_sizes():
    h = hadamard_matrix(64)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h, torch.eye(64), atol=1e-6, rtol=0)
    assert set((h.abs() * 8).round().unique().tolist()) == {1.0}  # entries +-1/sqrt(64)
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(96)


def test_value_rotation_spreads_an_outlier_channel_over_the_row():
    """Per-token 4-bit values with one large channel: the row's range is set by that channel, so
    the other channels get few levels; rotated, the range follows the row's norm."""
    torch.manual_seed(0)
    v = torch.randn(256, 2, 64)
    v[..., 7] *= 25
    plain = KiviLayout(4, 4, 64, 128, 64, dtype=torch.float32)
    rotated = KiviLayout(4, 4, 64, 128, 64, dtype=torch.float32, value_rotation="hadamard")
    k = torch.randn(256, 2, 64)
    kq_plain, vq_plain = fake_quant_kv(k, v, plain)
    kq_rot, vq_rot = fake_quant_kv(k, v, rotated)
    assert torch.equal(kq_plain, kq_rot)  # keys are not rotated
    err = {name: float((vq - v).norm() / v.norm()) for name, vq in (("plain", vq_plain),
                                                                   ("rotated", vq_rot))}
    assert err["rotated"] < 0.5 * err["plain"], err
    assert rotate_values(v, plain) is v
    torch.testing.assert_close(rotate_values(rotate_values(v, rotated), rotated), v,
                               atol=1e-5, rtol=1e-5)


def test_fake_quant_formats_and_errors():
    _, k, v = _outlier_kv(seq=40)
    kb, vb = fake_quant_kv(k, v, "bf16")
    assert torch.equal(kb, k.float())
    k8, _ = fake_quant_kv(k, v, "int8_per_token")
    assert torch.allclose(k8, fake_quant_per_token(k, 8))
    with pytest.raises(ValueError, match="unknown fmt"):
        fake_quant_kv(k, v, "int3")
    with pytest.raises(ValueError, match="key_mode"):
        fake_quant_kv(k, v, "kivi_4bit", key_mode="head", block_size=64)
