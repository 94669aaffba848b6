"""ACCEL_SPARSE_PREFILL's builder split and impl forward on a hand-made mixed batch.

No engine: a real ``VllmConfig`` of the tiny model, the real builders (vLLM's CPU builder as the
parent), a paged cache written by vLLM's own CPU cache writer, and vLLM's CPU attention impl as
the dense reference.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from vllm_accel.attention.sparse_prefill import backend as sp  # noqa: E402
from vllm_accel.attention.sparse_prefill.selection import LayerSelector  # noqa: E402
from vllm_accel.config import AccelConfigError  # noqa: E402
from vllm_accel.kernels.block_sparse_attention import (  # noqa: E402
    block_sparse_attention_reference,
    kv_cache_views_cpu,
)

HQ, HKV, D, PAGE = 4, 2, 64, 32
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
# (context, new tokens) per request, in the order vLLM's reorder gives with threshold 1:
# decodes, then extends (chunked prefill / prefix-cache hits), then fresh prefills.
BATCH = [(49, 1), (299, 1), (100, 40), (256, 200), (0, 60), (0, 300)]
THRESHOLD = 200  # -> requests 3 (seq 456) and 5 (seq 300) are sparse


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vllm_accel.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama"))


def _vllm_config(model_dir, dtype=torch.float32, **knobs):
    base = {"query_block_size": 64, "key_block_size": 32, "threshold": THRESHOLD}
    base.update(knobs)
    return VllmConfig(model_config=ModelConfig(model=model_dir, dtype=dtype,
                                               max_model_len=2048),
                      additional_config={"vllm_accel": {"sparse_prefill": base}})


class _Layer:
    def __init__(self, name, isa):
        self.layer_name, self.isa = name, isa
        self._k_scale_float = self._v_scale_float = 1.0


def _batch(seed=0, dtype=torch.float32, isa="vec"):
    """CommonAttentionMetadata, query, and a paged cache holding every request's K/V."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in BATCH]
    pages = [-(-s // PAGE) for s in seq_lens]
    perm = torch.randperm(sum(pages) + 2, generator=g)
    table = torch.zeros(len(BATCH), max(pages), dtype=torch.int32)
    used = 0
    for r, p in enumerate(pages):
        table[r, :p] = perm[used : used + p]
        used += p
    cache = torch.zeros(sum(pages) + 2, HKV, PAGE, 2 * D, dtype=dtype)
    tiles = cache.view(cache.shape[0], HKV, 2 * PAGE, D)
    from vllm import _custom_ops as ops

    slots_all = torch.cat([table[r, torch.arange(s) // PAGE].long() * PAGE + torch.arange(s) % PAGE
                           for r, s in enumerate(seq_lens)])
    n_all = int(slots_all.numel())
    k = torch.randn(n_all, HKV, D, generator=g).to(dtype)
    v = torch.randn(n_all, HKV, D, generator=g).to(dtype)
    key_tiles, value_tiles = tiles.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_tiles, value_tiles, slots_all, isa)
    q_lens = [n for _, n in BATCH]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    new_slots = torch.cat([table[r, torch.arange(c, c + n) // PAGE].long() * PAGE
                           + torch.arange(c, c + n) % PAGE for r, (c, n) in enumerate(BATCH)])
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(BATCH),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=table, slot_mapping=new_slots)
    query = torch.randn(int(qsl[-1]), HQ, D, generator=g).to(dtype)
    return cm, query, cache


def _builders(model_dir, dtype=torch.float32, **knobs):
    vc = _vllm_config(model_dir, dtype, **knobs)
    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=HKV, head_size=D, dtype=dtype)
    with set_current_vllm_config(vc):
        sparse = sp.SparsePrefillMetadataBuilder(spec, LAYERS, vc, torch.device("cpu"))
        dense = CPUAttentionMetadataBuilder(spec, LAYERS, vc, torch.device("cpu"))
        impl = sp.SparsePrefillImpl(num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HKV,
                                    alibi_slopes=None, sliding_window=None,
                                    kv_cache_dtype="auto")
        ref_impl = CPUAttentionBackendImpl(num_heads=HQ, head_size=D, scale=D**-0.5,
                                           num_kv_heads=HKV, alibi_slopes=None,
                                           sliding_window=None, kv_cache_dtype="auto")
    return sparse, dense, impl, ref_impl


def _dense_reference(dense_builder, ref_impl, cm, query, cache, isa):
    out = torch.zeros_like(query)
    ref_impl.forward(_Layer(LAYERS[0], isa), query, None, None, cache,
                     dense_builder.build(0, cm), out)
    return out


def test_builder_splits_decodes_short_and_long_prefills(model_dir):
    builder, _, _, _ = _builders(model_dir)
    assert builder.reorder_batch_threshold == 1
    cm, _, _ = _batch()
    meta = builder.build(0, cm)
    qsl = cm.query_start_loc_cpu.tolist()
    plan = meta.sparse
    assert plan.query_blocks.seq_lens == (456, 300) and plan.query_blocks.query_lens == (200, 300)
    assert plan.query_start_loc.tolist() == [0, 200, 500]
    assert torch.equal(plan.block_table, cm.block_table_tensor[[3, 5]])
    # requests 3 and 5 are not adjacent: their rows are an index
    assert plan.tokens.tolist() == list(range(qsl[3], qsl[4])) + list(range(qsl[5], qsl[6]))
    dense = meta.dense
    assert dense.metadata.seq_lens.tolist() == [50, 300, 140, 60]
    assert dense.metadata.query_start_loc.tolist() == [0, 1, 2, 42, 102]
    assert dense.tokens.tolist() == list(range(0, qsl[3])) + list(range(qsl[4], qsl[5]))
    assert meta.full is None  # no dense layer configured
    assert (meta.step.sparse_tokens, meta.step.decode_tokens, meta.step.dense_prefill_tokens) \
        == (500, 2, 100)


def test_builder_all_dense_below_threshold_and_for_method_dense(model_dir):
    cm, _, _ = _batch()
    for knobs in ({"threshold": 10_000}, {"method": "dense"}):
        builder, _, _, _ = _builders(model_dir, **knobs)
        meta = builder.build(0, cm)
        assert meta.sparse is None and meta.dense is None
        assert meta.full.seq_lens.tolist() == cm.seq_lens.tolist()


def test_contiguous_long_requests_are_a_slice(model_dir):
    builder, _, _, _ = _builders(model_dir, threshold=290)
    cm, _, _ = _batch()
    tail = sp.subset_common_metadata(cm, [0, 1, 2, 3], slice(0, 242))
    meta = builder.build(0, tail)  # only request 3 (seq 456) is long: rows 42..242
    assert meta.sparse.tokens == slice(42, 242)
    assert meta.dense.tokens == slice(0, 42)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2),
                                         (torch.float16, 4e-3)])
def test_density_one_equals_vllm_cpu_attention(model_dir, dtype, atol):
    builder, dense_builder, impl, ref_impl = _builders(model_dir, dtype, tau=None, density=1.0)
    cm, query, cache = _batch(dtype=dtype, isa=builder.isa)
    ref = _dense_reference(dense_builder, ref_impl, cm, query, cache, builder.isa)
    meta = builder.build(0, cm)
    out = torch.zeros_like(query)
    impl.forward(_Layer(LAYERS[1], builder.isa), query, None, None, cache, meta, out)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=1e-2)
    assert meta.step.sparse_layers == 1 and meta.step.density == pytest.approx(1.0)


def test_real_budget_sparse_rows_match_reference_dense_rows_match_vllm(model_dir, tmp_path):
    stats = tmp_path / "stats.jsonl"
    builder, dense_builder, impl, ref_impl = _builders(
        model_dir, tau=None, density=0.3, num_local_blocks=0, dense_layers=[0],
        stats_path=str(stats))
    cm, query, cache = _batch(seed=1, isa=builder.isa)
    ref = _dense_reference(dense_builder, ref_impl, cm, query, cache, builder.isa)
    meta = builder.build(0, cm)
    outs = []
    for name in LAYERS:  # one step: layer 0 dense, layers 1-3 sparse
        out = torch.zeros_like(query)
        impl.forward(_Layer(name, builder.isa), query, None, None, cache, meta, out)
        outs.append(out)
    torch.testing.assert_close(outs[0], ref, atol=2e-5, rtol=1e-4)  # dense layer
    plan = meta.sparse
    rows_dense, rows_sparse = meta.dense.tokens, plan.tokens
    torch.testing.assert_close(outs[1][rows_dense], ref[rows_dense], atol=2e-5, rtol=1e-4)
    k_cache, v_cache = kv_cache_views_cpu(cache, isa=builder.isa)
    q_s = query[rows_sparse].contiguous()
    selector = LayerSelector.for_layer(builder.config, builder.config.budget_for_layer(1), HKV)
    sel = selector.select(q_s, k_cache, plan.block_table, plan.seq_lens, plan.query_start_loc,
                          D**-0.5, plan.query_blocks)
    assert sel.density() < 0.8  # really sparse
    want = block_sparse_attention_reference(q_s, k_cache, v_cache, sel, plan.block_table,
                                            plan.seq_lens, plan.query_start_loc, scale=D**-0.5)
    torch.testing.assert_close(outs[1][rows_sparse], want, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(outs[1][rows_sparse], ref[rows_sparse], atol=1e-3)
    # the step closed after the 4th layer and wrote one JSON line
    assert meta.step.closed and meta.step.sparse_layers == 3
    (line,) = stats.read_text().splitlines()
    rec = json.loads(line)
    assert rec["sparse_tokens"] == 500 and rec["sparse_layers"] == 3
    assert 0 < rec["density"] < 0.8 and rec["attention_s"] > 0
    assert set(rec["layer_density"]) == {"1", "2", "3"}


def test_per_head_budgets(model_dir):
    builder, _, impl, _ = _builders(
        model_dir, tau=None, layer_budgets={"1": {"density": [1.0, 0.2]}})
    cm, query, cache = _batch(seed=2, isa=builder.isa)
    meta = builder.build(0, cm)
    plan = meta.sparse
    k_cache, _ = kv_cache_views_cpu(cache, isa=builder.isa)
    selector = LayerSelector.for_layer(builder.config, builder.config.budget_for_layer(1), HKV)
    assert selector.per_head
    sel = selector.select(query[plan.tokens].contiguous(), k_cache, plan.block_table,
                          plan.seq_lens, plan.query_start_loc, D**-0.5, plan.query_blocks)
    causal = plan.query_blocks.num_causal_key_blocks(sel.key_block_size)
    assert torch.equal(sel.block_counts[:, 0].long(), causal)  # head 0: every block
    assert (sel.block_counts[:, 1].long() < causal).any()  # head 1: a budget
    out = torch.zeros_like(query)
    impl.forward(_Layer(LAYERS[1], builder.isa), query, None, None, cache, meta, out)
    assert torch.isfinite(out).all()


def test_unsupported_configurations_fail_at_start_up(model_dir):
    vc = _vllm_config(model_dir)
    with set_current_vllm_config(vc):
        with pytest.raises(ValueError, match=r"ACCEL_SPARSE_PREFILL: .*a sliding window.*"
                                             r"ACCEL_BASE"):
            sp.SparsePrefillImpl(num_heads=HQ, head_size=D, scale=1.0, num_kv_heads=HKV,
                                 alibi_slopes=None, sliding_window=128, kv_cache_dtype="auto")
    reasons = sp.SparsePrefillBackend.validate_configuration(
        head_size=64, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=128,
        use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=None, attn_type="decoder",
        has_sliding_window=True)
    assert "kv_cache_dtype not supported" in reasons
    assert "sliding window not supported" in reasons
    with pytest.raises(RuntimeError, match=r"'neon' ISA.*ACCEL_BASE"):
        sp.check_kv_cache_layout("neon", torch.float32, 32, 64, 2)
    sp.check_kv_cache_layout("vec", torch.bfloat16, 128, 64, 2)  # the layout reads back
    sp.check_kv_cache_layout("vec16", torch.float32, 32, 80, 2)


def test_bad_model_knob_fails_in_the_builder(model_dir):
    vc = _vllm_config(model_dir, dense_layers=[7])
    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    with set_current_vllm_config(vc), pytest.raises(AccelConfigError, match="dense_layers"):
        sp.SparsePrefillMetadataBuilder(spec, LAYERS, vc, torch.device("cpu"))


def test_layer_index_from_module_names():
    assert sp.layer_index("model.layers.12.self_attn.attn") == 12
    assert sp.layer_index("language_model.model.layers.3.self_attn.attn") == 3
    assert sp.layer_index("attn") is None


def test_dense_tail_blocks_attend_to_every_causal_block(model_dir):
    builder, _, _, _ = _builders(model_dir, tau=None, density=0.2, dense_tail_blocks=1)
    cm, query, cache = _batch(seed=3, isa=builder.isa)
    plan = builder.build(0, cm).sparse
    k_cache, _ = kv_cache_views_cpu(cache, isa=builder.isa)
    selector = LayerSelector.for_layer(builder.config, builder.config.budget_for_layer(1), HKV)
    sel = selector.select(query[plan.tokens].contiguous(), k_cache, plan.block_table,
                          plan.seq_lens, plan.query_start_loc, D**-0.5, plan.query_blocks)
    causal = plan.query_blocks.num_causal_key_blocks(sel.key_block_size)
    offsets = plan.query_blocks.seq_block_offsets
    last_rows = [offsets[b + 1] - 1 for b in range(len(offsets) - 1)]
    assert all(bool((sel.block_counts[r].long() == causal[r]).all()) for r in last_rows)
    assert (sel.block_counts[: last_rows[0]].long() < causal[: last_rows[0], None]).any()
