"""Attention over the KIVI paged cache: torch reference vs fake-quant dense, Triton vs torch."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_accel.kernels import kivi_attention  # noqa: E402
from vllm_accel.kernels.kivi_attention import kivi_paged_attention  # noqa: E402
from vllm_accel.kernels.kivi_cache import quantize_on_write  # noqa: E402
from vllm_accel.kernels.kivi_format import KiviLayout, fake_quant_kv, reference_attention  # noqa: E402

needs_triton = pytest.mark.skipif(
    not (
        kivi_attention.HAS_TRITON
        and type(kivi_attention._kivi_attn_kernel).__name__ == "InterpretedFunction"
    ),
    reason="Triton missing, or imported before TRITON_INTERPRET=1 was set",
)


class Batch:
    """Sequences written into a KIVI cache (shuffled pages), plus queries for their last tokens."""

    def __init__(self, lay, lens, qlens, hq, hkv, q_dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        n, d = lay.block_size, lay.head_size
        pages = [-(-L // n) for L in lens]
        num_blocks = sum(pages) + 2
        perm = torch.randperm(num_blocks, generator=g)
        self.block_table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
        self.cache = lay.allocate(num_blocks, hkv)
        self.tail = lay.allocate_tail(2 * len(lens), hkv) if lay.residual == "tail" else None
        self.keys, self.values = [], []
        used = 0
        for i, L in enumerate(lens):
            self.block_table[i, : pages[i]] = perm[used : used + pages[i]]
            used += pages[i]
            k = torch.randn(L, hkv, d, generator=g)
            k[:, :, 1] = k[:, :, 1] * 12 + 4
            v = torch.randn(L, hkv, d, generator=g)
            self.keys.append(k)
            self.values.append(v)
            pos = torch.arange(L)
            slots = self.block_table[i][pos // n].long() * n + pos % n
            # entry 2i / 2i+1 alternate with the key group index
            tm = 2 * i + (pos // lay.key_group) % 2
            quantize_on_write(
                k,
                v,
                self.cache,
                slots,
                lay,
                k_tail=self.tail,
                tail_mapping=None if self.tail is None else tm,
            )
        self.tail_index = None
        if self.tail is not None:
            self.tail_index = torch.tensor(
                [2 * i + (L // lay.key_group) % 2 for i, L in enumerate(lens)]
            )
        self.query = torch.randn(sum(qlens), hq, d, generator=g).to(q_dtype)
        self.qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.lay = lay
        self.scale = d**-0.5

    def run(self, backend, **kw):
        return kivi_paged_attention(
            self.query,
            self.cache,
            self.block_table,
            self.seq_lens,
            self.qsl,
            self.scale,
            self.lay,
            k_tail=self.tail,
            tail_index=self.tail_index,
            backend=backend,
            **kw,
        )

    def fake_quant_reference(self):
        outs = []
        for i in range(len(self.keys)):
            fk, fv = fake_quant_kv(self.keys[i], self.values[i], self.lay)
            q = self.query[self.qsl[i] : self.qsl[i + 1]]
            outs.append(reference_attention(q, fk, fv, scale=self.scale))
        return torch.cat(outs)


# decode (1 query), prefill with context, a whole prompt, a sequence inside its first key group
LENS, QLENS = [75, 50, 32, 9], [1, 7, 32, 2]


@pytest.mark.parametrize(
    "lay",
    [
        KiviLayout(4, 4, 32, 32, 16, 16, torch.bfloat16, 0, "tail"),
        KiviLayout(2, 2, 32, 32, 16, 32, torch.bfloat16, 3, "page"),
        KiviLayout(4, 2, 64, 64, 32, 64, torch.float16, 4, "tail"),
        KiviLayout(4, 4, 32, 32, 16, 16, torch.float32, 0, "page"),
        KiviLayout(4, 4, 32, 32, 16, 32, torch.bfloat16, 3, "tail", "hadamard"),
    ],
    ids=lambda lay: (f"K{lay.bits_k}V{lay.bits_v}-{lay.residual}-S{lay.sink_tokens}"
                     f"-{lay.value_rotation}"),
)
def test_torch_reference_equals_dense_attention_on_fake_quantized_kv(lay):
    b = Batch(lay, LENS, QLENS, hq=4, hkv=2)
    out = b.run("torch")
    ref = b.fake_quant_reference()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_attention_error_against_unquantized_kv_is_small_for_4bit():
    lay = KiviLayout(4, 4, 64, 64, 32, 64)
    b = Batch(lay, [200, 130], [1, 30], hq=8, hkv=2)
    out = b.run("torch")
    exact = torch.cat(
        [
            reference_attention(
                b.query[b.qsl[i] : b.qsl[i + 1]], b.keys[i], b.values[i], scale=b.scale
            )
            for i in range(2)
        ]
    )
    assert float((out - exact).norm() / exact.norm()) < 0.2


def test_argument_errors():
    lay = KiviLayout(4, 4, 32, 32, 16)
    b = Batch(lay, [20], [1], hq=2, hkv=2)
    with pytest.raises(ValueError, match="tail_index"):
        kivi_paged_attention(
            b.query, b.cache, b.block_table, b.seq_lens, b.qsl, 1.0, lay, k_tail=b.tail
        )
    with pytest.raises(ValueError, match="multiple of KV heads"):
        kivi_paged_attention(
            torch.zeros(1, 3, 32),
            b.cache,
            b.block_table,
            b.seq_lens,
            b.qsl,
            1.0,
            lay,
            k_tail=b.tail,
            tail_index=b.tail_index,
        )
    with pytest.raises(ValueError, match="head_size"):
        kivi_paged_attention(
            torch.zeros(1, 2, 16),
            b.cache,
            b.block_table,
            b.seq_lens,
            b.qsl,
            1.0,
            lay,
            k_tail=b.tail,
            tail_index=b.tail_index,
        )


# ---------------------------------------------------------------------------- Triton vs torch
@needs_triton
@pytest.mark.parametrize(
    "lay,splits,fold",
    [
        (KiviLayout(4, 4, 32, 32, 16, 16, torch.bfloat16, 0, "tail"), 1, True),
        (KiviLayout(2, 4, 32, 32, 16, 32, torch.bfloat16, 3, "page"), 3, True),
        (KiviLayout(4, 2, 32, 32, 16, 32, torch.float16, 2, "tail"), 2, False),
        (KiviLayout(4, 4, 32, 32, 16, 16, torch.float32, 0, "page"), 2, True),
        (KiviLayout(4, 4, 32, 32, 16, 32, torch.bfloat16, 2, "tail", "hadamard"), 2, True),
    ],
    ids=[
        "K4V4-tail-VG16-1split",
        "K2V4-page-sinks-folded-3splits",
        "K4V2-tail-sinks-unfolded-2splits",
        "K4V4-page-float32-2splits",
        "K4V4-tail-sinks-hadamard-2splits",
    ],
)
def test_triton_fused_attention_matches_torch(lay, splits, fold):
    """Mixed batch: decode, prefill with context, whole prompt, unfinished first key group."""
    b = Batch(lay, LENS, QLENS, hq=4, hkv=2)
    ref = b.run("torch")
    out = b.run("triton", num_splits=splits, block_m=16, fold=fold)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@needs_triton
def test_triton_decode_batch_non_power_of_two_gqa_bf16():
    """Decode step (one query per sequence), 7 query heads per KV head, bf16 queries/outputs."""
    lay = KiviLayout(4, 2, 32, 32, 16, 16, torch.bfloat16, 2, "tail")
    b = Batch(lay, [70, 33, 16], [1, 1, 1], hq=14, hkv=2, q_dtype=torch.bfloat16, seed=3)
    ref = b.run("torch")
    assert ref.dtype == torch.bfloat16
    for splits in (1, 2):
        out = b.run("triton", num_splits=splits, max_query_len=1, max_seq_len=70)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="block_n"):
        b.run("triton", block_n=24)
