"""The connector's APE adapter (kv_connector/ape.py) on a stand-in attention impl."""

from __future__ import annotations

import pytest
import torch

from vllm_accel.attention import step_requests
from vllm_accel.kernels.ape_attention import ape_attention, causal_attention_reference
from vllm_accel.kv_connector import ape
from vllm_accel.kv_connector.config import ChunkReuseConfigError, parse_config
from vllm_accel.kv_connector.paged_kv import PagedLayerKV

HEADS, KV_HEADS, DIM, PAGE = 4, 2, 8, 4


class _Impl:
    """Ordinary causal attention over a 'plain' CPU page layout, like vLLM's impl."""

    def __init__(self, sliding_window=None):
        self.scale, self.sliding_window = DIM ** -0.5, sliding_window

    def forward(self, layer, query, key, value, kv_cache, meta, output=None):
        pages = PagedLayerKV(kv_cache, PAGE, "plain")
        starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        for i in range(len(starts) - 1):
            lo, hi, n = starts[i], starts[i + 1], lens[i]
            k, v = pages.read(meta.block_table[i], torch.arange(n))
            output[lo:hi] = causal_attention_reference(query[lo:hi], k, v,
                                                       torch.arange(n - (hi - lo), n), self.scale)
        return output


class _Layer:
    def __init__(self, impl):
        self.impl = impl


class _Meta:
    def __init__(self, starts, lens, table):
        self.query_start_loc, self.seq_lens = torch.tensor(starts), torch.tensor(lens)
        self.block_table = torch.tensor(table)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(8, KV_HEADS, PAGE, 2 * DIM, generator=g)
    # request "a": 12 keys in pages 0-2, 3 query rows (prefill tail); "b": 7 keys in pages 3-4,
    # 1 row (decode)
    meta = _Meta([0, 3, 4], [12, 7], [[0, 1, 2], [3, 4, 5]])
    query = torch.randn(4, HEADS, DIM, generator=g)
    step_requests.publish(step_requests.StepRequests(torch.tensor([10, 7]), ["a", "b"], {"a", "b"}))
    step_requests.publish(None)
    return kv_cache, meta, query


def _run(impl, kv_cache, meta, query):
    layer = _Layer(impl)
    out = torch.zeros(4, HEADS * DIM)
    impl.forward(layer, query, None, None, kv_cache, meta, out.view(4, HEADS, DIM))
    return out.view(4, HEADS, DIM)


def test_registered_rows_get_ape_and_the_others_are_untouched(batch, monkeypatch):
    kv_cache, meta, query = batch
    plain = _run(_Impl(), kv_cache, meta, query)
    registry = ape.ApeRegistry(temperature=0.5, chunk_scale=0.9)
    impl = _Impl()
    monkeypatch.setattr("vllm_accel._patches.attention_step_requests.enable", lambda: None)
    pages_of = {"layer.0": PagedLayerKV(kv_cache, PAGE, "plain")}.__getitem__
    assert ape.install({"layer.0": _Layer(impl)}, registry, pages_of) == 1
    assert type(impl) is _Impl and isinstance(impl.forward, ape._ApeForward)
    assert ape.install({"layer.0": _Layer(impl)}, registry, pages_of) == 1  # not twice
    assert impl.forward.inner.__func__ is _Impl.forward
    torch.testing.assert_close(_run(impl, kv_cache, meta, query), plain)  # nothing registered
    registry.record("a", [2, 3, 4, 5, 6], length=9)
    got = _run(impl, kv_cache, meta, query)
    torch.testing.assert_close(got[3:], plain[3:])  # request b: vLLM's output
    k, v = PagedLayerKV(kv_cache, PAGE, "plain").read(torch.tensor([0, 1, 2]), torch.arange(12))
    mask = torch.zeros(12, dtype=torch.bool)
    mask[2:7] = True
    want = ape_attention(query[:3], k, v, torch.arange(9, 12), mask, DIM ** -0.5, 0.5, 0.9)
    torch.testing.assert_close(got[:3], want)
    assert not torch.allclose(got[:3], plain[:3], atol=1e-3)
    assert registry.take_token_layers() == 3 and registry.token_layers == 0
    registry.drop({"a"})
    torch.testing.assert_close(_run(impl, kv_cache, meta, query), plain)


def test_unsupported_attention_is_refused(monkeypatch):
    monkeypatch.setattr("vllm_accel._patches.attention_step_requests.enable", lambda: None)
    with pytest.raises(ValueError, match="sliding window"):
        ape.install({"layer.0": _Layer(_Impl(sliding_window=(128, 0)))},
                    ape.ApeRegistry(0.5, 1.0), lambda name: None)


def test_knobs():
    assert not parse_config({}).ape
    assert parse_config({"attention_temperature": 0.6}).ape
    assert parse_config({"attention_scale": 0.9}).ape
    with pytest.raises(ChunkReuseConfigError, match="attention_temperature"):
        parse_config({"attention_temperature": 0})
    with pytest.raises(ChunkReuseConfigError, match="attention_scale"):
        parse_config({"attention_scale": 3})
