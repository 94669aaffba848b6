"""The backend's KV cache spec carries the real bytes of a quantized page."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_accel.kernels.kivi_format import KiviLayout
from vllm_accel.kv_quant import backend as kivi_backend
from vllm_accel.kv_quant.backend import Kivi2BitBackend, Kivi4BitBackend, page_layout
from vllm_accel.kv_quant.config import KvQuantKnobs


def _spec(block_size=128, head_size=64, heads=2, dtype=torch.uint8):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size,
                             dtype=dtype)


@pytest.fixture
def page_residual(monkeypatch):
    monkeypatch.setattr(kivi_backend, "page_format",
                        lambda: (KvQuantKnobs(residual="page"), torch.bfloat16))


@pytest.mark.parametrize("backend, bytes_per_token_head", [
    (Kivi4BitBackend, 72),  # 64 code bytes + 8 scale bytes (residual keys in the tail pool)
    (Kivi2BitBackend, 40),
])
def test_state_content_bytes_is_the_layout_size(backend, bytes_per_token_head):
    spec = backend.customize_spec(_spec())
    layout = page_layout(backend.KV_CACHE_DTYPE, 64, 128)
    assert spec.state_content_bytes == layout.bytes_per_token_head == bytes_per_token_head
    # vLLM sizes pages (and so the "KV cache size: N tokens" line) from this
    assert spec.page_size_bytes == 2 * 128 * bytes_per_token_head
    assert spec.page_size_bytes == 2 * layout.page_bytes


def test_capacity_ratio_against_bf16_at_head_size_64():
    bf16 = _spec(dtype=torch.bfloat16).page_size_bytes
    assert bf16 / Kivi4BitBackend.customize_spec(_spec()).page_size_bytes == pytest.approx(
        256 / 72)
    assert bf16 / Kivi2BitBackend.customize_spec(_spec()).page_size_bytes == pytest.approx(
        256 / 40)


def test_page_residual_costs_its_area(page_residual):
    # 64 code + 8 scale bytes + 64 residual bytes per token and head at block 128
    assert Kivi4BitBackend.customize_spec(_spec()).state_content_bytes == 136
    assert Kivi2BitBackend.customize_spec(_spec()).state_content_bytes == 104


def test_larger_blocks_amortise_the_page_residual(page_residual):
    c128 = Kivi4BitBackend.customize_spec(_spec(block_size=128)).state_content_bytes
    c256 = Kivi4BitBackend.customize_spec(_spec(block_size=256)).state_content_bytes
    assert c256 < c128
    assert c256 == KiviLayout.preset("kivi_4bit", 64, 256, residual="page").bytes_per_token_head


def test_per_token_query_uses_the_default_cpu_block(page_residual):
    # vLLM asks customize_spec for block_size=1 pages when aligning hybrid models
    assert Kivi4BitBackend.customize_spec(_spec(block_size=1)).state_content_bytes == 136


def test_spec_must_be_bytes():
    with pytest.raises(ValueError, match="expected torch.uint8"):
        Kivi4BitBackend.customize_spec(_spec(dtype=torch.bfloat16))


def test_kernel_block_sizes_are_whole_key_groups():
    (size,) = Kivi4BitBackend.get_supported_kernel_block_sizes()
    assert size.base == 64
    assert Kivi4BitBackend.supports_block_size(128)
    assert not Kivi4BitBackend.supports_block_size(32)


@pytest.mark.parametrize("knobs", [KvQuantKnobs(sink_tokens=8), KvQuantKnobs(residual="page")])
def test_page_bytes_follow_the_model_dtype_of_full_precision_rows(monkeypatch, knobs):
    """Sink rows and the in-page residual are stored in the model dtype: a float32 model's
    page is larger than a bf16 one's, and the spec must say so (the worker checks the cache it
    is given against its own layout)."""
    sizes = {}
    for dtype in (torch.bfloat16, torch.float32):
        monkeypatch.setattr(kivi_backend, "page_format", lambda dtype=dtype: (knobs, dtype))
        sizes[dtype] = Kivi4BitBackend.customize_spec(_spec()).state_content_bytes
        assert sizes[dtype] == page_layout("kivi_4bit", 64, 128, dtype, knobs).bytes_per_token_head
    assert sizes[torch.float32] > sizes[torch.bfloat16]
