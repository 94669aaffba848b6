"""Chunk markup, keys, the reuse plan and the connector's config: pure logic, no vLLM."""

from __future__ import annotations

import logging

import pytest

from vllm_accel.kv_connector.chunking import (
    ChunkMarkupError,
    Span,
    find_chunks,
    spans_from_separator,
)
from vllm_accel.kv_connector.config import ChunkReuseConfigError, parse_config
from vllm_accel.kv_connector.identity import chunk_key, model_fingerprint
from vllm_accel.kv_connector.planner import (
    PlannedChunk,
    approx_start,
    chunks_to_save,
    plan_reuse,
    windows_by_rank,
)

S = 9  # separator id


def test_separator_chunks_cover_everything_before_the_last_separator():
    tokens = [1, 2, S, 3, 4, 5, S, 6, S, 7, 8]
    assert spans_from_separator(tokens, S) == [Span(0, 2), Span(2, 6), Span(6, 8)]
    # no prefix, and fewer than two separators: nothing reusable
    assert spans_from_separator([S, 3, S, 4], S) == [Span(0, 2)]
    assert spans_from_separator([1, S, 3], S) == []


def test_explicit_spans_fill_gaps_and_win_over_separator():
    tokens = list(range(20))
    spans = find_chunks(tokens, S, {"chunk_spans": [[3, 7], [7, 12]]})
    assert spans == [Span(0, 3), Span(3, 7), Span(7, 12)]
    assert find_chunks([1, S, 2, S, 3], S, {"chunk_reuse": False}) == []


@pytest.mark.parametrize("params", [
    {"chunk_spans": [[5, 3]]}, {"chunk_spans": [[0, 4], [2, 6]]}, {"chunk_spans": [[0, 20]]},
    {"chunk_spans": "0-4"}, {"chunk_spans": [[0, 1.5]]}, {"chunk_reuse": "yes"}, ["x"],
])
def test_malformed_params_raise(params):
    with pytest.raises(ChunkMarkupError):
        find_chunks(list(range(20)), S, params)


def test_keys_separate_models_salts_and_tokens():
    fp = model_fingerprint("m", "t", "float32", "auto", {"rope_theta": 1e6})
    other = model_fingerprint("m", "t", "bfloat16", "auto", {"rope_theta": 1e6})
    rope = model_fingerprint("m", "t", "float32", "auto", {"rope_theta": 1e4})
    assert len({fp, other, rope}) == 3
    base = chunk_key(fp, None, [1, 2, 3])
    assert base == chunk_key(fp, "", [1, 2, 3])
    assert base != chunk_key(fp, "tenant-a", [1, 2, 3])
    assert chunk_key(fp, "tenant-a", [1, 2, 3]) != chunk_key(fp, "tenant-b", [1, 2, 3])
    assert base != chunk_key(fp, None, [1, 2, 4]) != chunk_key(other, None, [1, 2, 3])


def _chunks(spans, stored):
    return [PlannedChunk(Span(a, b), f"k{a}", s) for (a, b), s in zip(spans, stored)]


def test_plan_claims_to_the_last_stored_chunk_block_aligned():
    chunks = _chunks([(0, 10), (10, 40), (40, 75), (75, 100)], [True, True, False, True])
    plan = plan_reuse(chunks, prompt_len=130, local=0, block_size=16, min_reuse_tokens=1,
                      epic_tokens=4)
    assert plan.claim_end == 96  # 100 rounded down to a block
    assert plan.num_external == 96
    assert plan.forced == list(range(40, 75))  # the chunk the store lacks is recomputed
    assert [(ld.position, ld.offset, ld.count) for ld in plan.loads] == [
        (0, 0, 10), (10, 0, 30), (75, 0, 21)]
    assert plan.epic == [10, 11, 12, 13, 75, 76, 77, 78]  # not the exact chunk at position 0
    assert approx_start(plan) == 10
    assert 5 not in plan.candidates and 10 in plan.candidates


def test_plan_respects_local_hit_limits_and_minimum():
    chunks = _chunks([(0, 32), (32, 64)], [True, True])
    plan = plan_reuse(chunks, prompt_len=64, local=16, block_size=16, min_reuse_tokens=1,
                      epic_tokens=2)
    assert plan.claim_end == 48  # the last prompt token is always computed -> 63 -> 48
    assert plan.loads[0].position == 16 and plan.loads[0].offset == 16
    assert plan_reuse(chunks, 200, 0, 16, min_reuse_tokens=65, epic_tokens=0).num_external == 0
    nothing = _chunks([(0, 32), (32, 64)], [False, False])
    assert plan_reuse(nothing, 200, 0, 16, 1, 0).num_external == 0


def test_chunks_to_save_waits_for_complete_chunks():
    chunks = _chunks([(0, 10), (10, 40), (40, 75)], [False, True, False])
    assert [c.key for c in chunks_to_save(chunks, set(), 39)] == ["k0"]
    assert [c.key for c in chunks_to_save(chunks, {"k0"}, 80)] == ["k40"]


def test_config_errors_name_the_knob():
    assert parse_config({}).recompute == "query"
    assert parse_config({"stores": "memory", "recompute": "cacheblend"}).stores == ("memory",)
    for bad, name in [({"recompute": "all"}, "recompute"), ({"recompute_ratio": 2}, "ratio"),
                      ({"epic_tokens": 1.5}, "epic_tokens"), ({"stores": []}, "stores"),
                      ({"recompute_policy": "epic"}, "recompute_policy"),
                      ({"log_interval_s": -1}, "log_interval_s"),
                      ({"query_draft_tokens": 65}, "query_draft_tokens"),
                      ({"recompute": "epic", "query_draft_tokens": 4}, "recompute to query")]:
        with pytest.raises(ChunkReuseConfigError, match=name):
            parse_config(bad)


def test_counters_log_at_their_interval(caplog):
    pytest.importorskip("vllm")
    from vllm_accel.kv_connector.metrics import ReuseCounters

    caplog.set_level(logging.INFO, logger="vllm.accel")
    every, hourly = ReuseCounters("scheduler", 0.0), ReuseCounters("worker", 3600.0)
    for counters in (every, hourly):
        counters.add("reused_requests")
        counters.maybe_log()
    lines = [r.getMessage() for r in caplog.records if "chunk reuse" in r.getMessage()]
    assert lines == ["chunk reuse (scheduler): reused_requests=1; stores: {}"]
    hourly.maybe_log(force=True)  # shutdown
    assert "chunk reuse (worker): reused_requests=1" in caplog.records[-1].getMessage()


def test_retagging_moves_blended_blocks_off_the_exact_chain():
    pytest.importorskip("vllm")
    from vllm_accel.kv_connector.connector import retag_block_hashes

    class Request:
        block_hashes = [bytes([i]) * 32 for i in range(5)]

    request = Request()
    original = list(request.block_hashes)
    retag_block_hashes(request, start_token=2 * 16 + 3, hash_block_size=16)
    assert request.block_hashes[:2] == original[:2]  # exact prefix blocks keep their hashes
    assert all(new != old for new, old in zip(request.block_hashes[2:], original[2:]))
    assert len(set(request.block_hashes)) == 5
    assert all(isinstance(h, bytes) and len(h) == 32 for h in request.block_hashes)


def test_query_windows_take_ranked_tokens_with_neighbours_up_to_the_budget():
    allowed = set(range(10, 100))
    # 50 first: 46..54; then 12: 10..16 (8, 9 are not allowed); 53 is already taken; then 90
    assert windows_by_rank([50, 12, 53, 90], allowed, 100, 4) == [*range(10, 17),
                                                                  *range(46, 55), *range(86, 95)]
    # the budget cuts the last window, keeping the positions nearest its seed
    assert windows_by_rank([50, 90], allowed, 12, 4) == [*range(46, 55), 89, 90, 91]
    assert windows_by_rank([50], allowed, 0, 4) == []
    assert windows_by_rank([50, 60], allowed, 3, 0) == [50, 60]
    # asymmetric windows (the selection study's forward-leaning variant): 1 before, 6 after
    assert windows_by_rank([50], allowed, 100, 1, after=6) == [*range(49, 57)]
    assert windows_by_rank([50], allowed, 3, 1, after=6) == [49, 50, 51]
