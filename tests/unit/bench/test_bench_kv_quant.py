"""The kv-quant bench gives both sides the same memory: the KIVI side's KV budget is net of the
residual pool the worker allocates, and the report counts the pool in the bytes per token."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_accel.bench import kv_quant
from vllm_accel.kv_quant.tail_pool import TailPool

LAYERS, HEADS, KV_HEADS, HIDDEN = 3, 4, 2, 256  # head size 64


def _engine(tmp_path, **extra):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "hidden_size": HIDDEN}))
    return {"model": str(tmp_path), **kv_quant.engine_extra("kivi_4bit"), **extra}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_budget_is_net_of_the_pool_the_worker_allocates(tmp_path, dtype):
    model_dtype = str(dtype).replace("torch.", "")
    engine = kv_quant.finish_engine(_engine(tmp_path, dtype=model_dtype))
    pool = TailPool([f"l{i}" for i in range(LAYERS)], num_kv_heads=KV_HEADS, key_group=64,
                    head_size=HIDDEN // HEADS, dtype=dtype, device="cpu",
                    max_requests=kv_quant.MAX_NUM_SEQS, entries_per_slot=1)
    assert kv_quant.KV_CACHE_BYTES - engine["kv_cache_memory_bytes"] == pool.nbytes > 0


def test_no_pool_for_bf16_page_residual_or_two_entries_with_drafts(tmp_path):
    assert kv_quant.residual_pool_bytes(_engine(tmp_path, kv_cache_dtype="auto")) == 0
    page = {"vllm_accel": {"kv_quant": {"residual": "page"}}}
    assert kv_quant.residual_pool_bytes(_engine(tmp_path, additional_config=page)) == 0
    one = kv_quant.residual_pool_bytes(_engine(tmp_path))
    two = kv_quant.residual_pool_bytes(_engine(tmp_path, speculative_config={"method": "x"}))
    assert two == 2 * one


def test_prompt_buffer_bytes_follow_the_knob_and_the_prefill_mode(tmp_path):
    """The most the exact prompt buffer holds: 8192 tokens of K and V in every layer by
    default; nothing with ``prefill_kv: cache``, ``prompt_exact_tokens: 0`` or a bf16 cache."""
    def knobs(**kv_quant_knobs):
        return kv_quant.engine_extra("kivi_4bit", knobs=kv_quant_knobs)

    head_size = HIDDEN // HEADS
    assert kv_quant.prompt_buffer_bytes(_engine(tmp_path)) == (
        8192 * LAYERS * KV_HEADS * head_size * 2 * torch.bfloat16.itemsize)
    assert kv_quant.prompt_buffer_bytes(_engine(tmp_path, **{**knobs(prompt_exact_tokens=64),
                                                             "dtype": "float32"})) == (
        64 * LAYERS * KV_HEADS * head_size * 2 * 4)
    for off in (knobs(prefill_kv="cache"), knobs(prompt_exact_tokens=0),
                {"kv_cache_dtype": "auto"}):
        assert kv_quant.prompt_buffer_bytes(_engine(tmp_path, **off)) == 0


def test_report_counts_the_pool_in_the_bytes_per_token(tmp_path):
    base = {"engine": {"kv_cache_memory_bytes": kv_quant.KV_CACHE_BYTES},
            "num_kv_blocks": 100, "block_size": 128}
    engine = kv_quant.finish_engine(_engine(tmp_path))
    quant = {"engine": engine, "num_kv_blocks": 350, "block_size": 128}
    ratios, _ = kv_quant.report(base, quant)
    assert ratios["kv_capacity_ratio"] == 3.5
    assert ratios["kv_bytes_per_token_quant"] == kv_quant.KV_CACHE_BYTES / (350 * 128)
    assert ratios["tail_pool_bytes"] == kv_quant.KV_CACHE_BYTES - engine["kv_cache_memory_bytes"]
    assert ratios["prompt_buffer_bytes"] == kv_quant.prompt_buffer_bytes(engine) > 0


@pytest.mark.parametrize("prefill_kv", [None, "cache"])
def test_report_says_which_keys_prefill_attended_to(tmp_path, prefill_kv):
    """Under ``exact`` prompt perplexity reads unquantized K/V: the report must say which."""
    knobs = {"prefill_kv": prefill_kv} if prefill_kv else None
    engine = _engine(tmp_path, **kv_quant.engine_extra("kivi_4bit", knobs=knobs))
    side = {"engine": engine, "num_kv_blocks": 1, "block_size": 128, "perplexity": 9.0}
    _, quality = kv_quant.report({**side, "engine": {"kv_cache_memory_bytes": 1}}, side)
    assert quality["prefill_kv"] == quality["kv_quant"]["prefill_kv"] == (prefill_kv or "auto")


def test_format_knobs_reach_the_engine_the_pool_and_the_report(tmp_path):
    from vllm_accel.cli import _kv_quant_knobs

    knobs = _kv_quant_knobs(["key_group=32", "sink_tokens=4"], "cache")
    assert knobs == {"key_group": 32, "sink_tokens": 4, "prefill_kv": "cache"}
    engine = _engine(tmp_path, **kv_quant.engine_extra("kivi_4bit", knobs=knobs))
    assert engine["additional_config"] == {"vllm_accel": {"kv_quant": knobs}}
    # the pool holds one 32-token key group per request: half the default's
    assert 2 * kv_quant.residual_pool_bytes(engine) == kv_quant.residual_pool_bytes(
        _engine(tmp_path))
    side = {"engine": engine, "num_kv_blocks": 1, "block_size": 128}
    _, quality = kv_quant.report({**side, "engine": {"kv_cache_memory_bytes": 1}}, side)
    assert (quality["kv_quant"]["key_group"], quality["kv_quant"]["sink_tokens"]) == (32, 4)
    for bad, message in ((["sink_tokens"], "KNOB=VALUE"), (["sinks=4"], "unknown key"),
                         (["key_group=48"], "key_group=48")):
        with pytest.raises(ValueError, match=message):
            _kv_quant_knobs(bad, None)


@pytest.mark.parametrize("rotation,other", [(None, "none"), ("auto", "none"),
                                            ("hadamard", "none"), ("none", "hadamard")])
def test_extra_side_switches_the_value_rotation_and_keeps_the_rest(tmp_path, rotation, other):
    """``--set extra_sides=true``: the KIVI side again with the other value rotation, the same
    knobs and, once ``run_feature`` nets the pool again, the same KV budget."""
    knobs = {"sink_tokens": 1, **({"value_rotation": rotation} if rotation else {})}
    engine = kv_quant.finish_engine(_engine(tmp_path, **kv_quant.engine_extra("kivi_4bit",
                                                                              knobs=knobs)))
    sides = kv_quant.other_value_rotation(None, {"engine": engine})
    assert list(sides) == [f"value_rotation_{other}"]
    extra = sides[f"value_rotation_{other}"]
    assert extra["additional_config"] == {"vllm_accel": {"kv_quant": {
        "sink_tokens": 1, "value_rotation": other}}}
    assert engine["additional_config"]["vllm_accel"]["kv_quant"] == knobs  # not mutated
    assert kv_quant.finish_engine(extra)["kv_cache_memory_bytes"] == engine[
        "kv_cache_memory_bytes"]
    assert {k: v for k, v in extra.items() if k != "additional_config"} == {
        k: v for k, v in engine.items() if k not in ("additional_config",
                                                     "kv_cache_memory_bytes")} | {
        "kv_cache_memory_bytes": kv_quant.KV_CACHE_BYTES}
