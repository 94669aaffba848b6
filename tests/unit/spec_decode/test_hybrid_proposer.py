"""HybridProposer without an engine: source choice by expected accepted length, back-off,
probes, learning from accepted tokens, failures."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_accel.spec_decode import HybridProposer, recycling_proposer, sam_proposer
from vllm_accel.spec_decode.acceptance import Candidate, SourceRates, choose

MAX_LEN = 256


@pytest.fixture(autouse=True)
def no_runtime_patches(monkeypatch):
    monkeypatch.setattr(sam_proposer, "_enable_batch_api", lambda: True)
    monkeypatch.setattr(recycling_proposer, "_enable_target_logits", lambda: True)


def make_config(knobs=None, k=8):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        additional_config={"vllm_accel": {"spec_decode": knobs}} if knobs else {},
        model_config=SimpleNamespace(max_model_len=MAX_LEN, get_vocab_size=lambda: 300,
                                     tokenizer="unused", tokenizer_revision=None,
                                     trust_remote_code=False))


class FakeSource:
    """Stands in for SAMProposer / RecyclingProposer: drafts what the test says."""

    def __init__(self, drafts_by_req=None):
        self.drafts_by_req = drafts_by_req or {}
        self.req_ids: list[str] = []

    def propose_with_batch(self, k, batch, sampled):
        return [list(self.drafts_by_req.get(r, []))[:k] if s else []
                for r, s in zip(batch.req_ids, sampled)]

    def propose_rows(self, k, sampled, num_tokens):
        return [list(self.drafts_by_req.get(r, []))[:k] if s else []
                for r, s in zip(self.req_ids, sampled)]


def hybrid(knobs=None, sam=None, recycling=None):
    h = HybridProposer(make_config(knobs))
    h.sam = FakeSource(sam)
    h.recycling = FakeSource(recycling)
    return h


def step(h, req_ids, sampled):
    h.recycling.req_ids = list(req_ids)
    batch = SimpleNamespace(req_ids=list(req_ids),
                            req_id_to_index={r: i for i, r in enumerate(req_ids)},
                            num_tokens_no_spec=np.full(len(req_ids), 50))
    return h.propose_with_batch(8, batch, sampled)


# ---------------------------------------------------------------------------- the rule


def test_choose_takes_the_longest_expected_accepted_length_above_the_cost():
    rates = SourceRates(0.5, {"sam": 0.6, "recycling": 0.3})
    sam, rec = Candidate("sam", [1, 2]), Candidate("recycling", [3, 4, 5, 6, 7])
    assert choose([sam, rec], rates, 0.1) is rec  # 0.3 * 5 > 0.6 * 2
    assert choose([Candidate("sam", [1, 2, 3]), rec], rates, 0.1).source == "sam"  # 1.8 > 1.5
    assert choose([sam, rec], rates, 0.4) is sam  # recycling does not pay for its verification
    assert choose([sam, rec], rates, 0.7) is None  # neither does: back off
    assert choose([Candidate("sam", []), rec], rates, 0.7, probe={"sam"}) is None
    probe = choose([sam, rec], rates, 0.7, probe={"recycling"}, probe_len=2)
    assert probe.source == "recycling" and probe.draft == [3, 4]


def test_rates_are_moving_averages_of_accepted_per_drafted_token():
    rates = SourceRates(0.5, {"sam": 0.6})
    rates.observe("sam", drafted=4, accepted=4)
    assert rates.rate("sam") == pytest.approx(0.8)
    rates.observe("sam", drafted=4, accepted=0)
    assert rates.rate("sam") == pytest.approx(0.4)
    rates.observe("sam", drafted=2, accepted=5)  # the bonus token is not a drafted token
    assert rates.rate("sam") == pytest.approx(0.7)
    rates.observe("sam", drafted=0, accepted=0)  # no draft: nothing learned
    assert rates.rate("sam") == pytest.approx(0.7)


# ---------------------------------------------------------------------------- the proposer


def test_picks_per_request_and_learns_from_the_sampled_lengths():
    h = hybrid(knobs={"hybrid_ema_weight": 0.5},
               sam={"a": [1, 2, 3, 4, 5, 6]}, recycling={"a": [7, 8], "b": [9, 9]})
    assert step(h, ["a", "b"], [[10], [11]]) == [[1, 2, 3, 4, 5, 6], [9, 9]]
    # a: 6 drafted, 6 accepted (+ bonus); b: 2 drafted, none accepted
    assert step(h, ["a", "b"], [[1, 2, 3, 4, 5, 6, 12], [13]]) == [[1, 2, 3, 4, 5, 6], [9, 9]]
    a, b = h._requests["a"], h._requests["b"]
    assert a.rates.rate("sam") == pytest.approx(0.8)
    assert b.rates.rate("recycling") == pytest.approx(0.15)
    assert h.rates.rate("sam") == pytest.approx(0.8)  # global rates learn too
    assert h.counts == {"sam": 2, "recycling": 2, "none": 0}


def test_backs_off_when_drafts_keep_missing_and_probes_to_recover():
    h = hybrid(knobs={"hybrid_verify_cost": 0.2, "hybrid_ema_weight": 0.5,
                      "hybrid_probe_every": 4},
               recycling={"chat": [5, 6, 7, 8]})
    out = [step(h, ["chat"], [[1]])]
    for _ in range(10):  # every recycled token is rejected
        out.append(step(h, ["chat"], [[1]]))
    # drafts at first (prior 0.3), then none once the rate fell below the verify cost
    # (0.3 -> 0.15), except a 2-token probe every 4 steps
    assert out == [[[5, 6, 7, 8]], [[]], [[]], [[]], [[5, 6]], [[]], [[]], [[]], [[5, 6]],
                   [[]], [[]]]
    # the next probe is accepted: the rate recovers above the cost and full drafts resume
    assert [step(h, ["chat"], [[1]]) for _ in range(2)] == [[[]], [[5, 6]]]
    assert step(h, ["chat"], [[5, 6, 2]]) == [[5, 6, 7, 8]]  # 0.5 * 0.04 + 0.5 * 1.0 > 0.2
    assert h.counts["none"] > h.counts["recycling"]


def test_a_new_request_starts_from_the_global_rates():
    h = hybrid(knobs={"hybrid_verify_cost": 0.2, "hybrid_ema_weight": 1.0},
               recycling={"a": [5, 6], "b": [5, 6]})
    step(h, ["a"], [[1]])
    step(h, ["a"], [[1]])  # a's recycled drafts are all rejected: global rate 0.0
    assert step(h, ["b"], [[1]]) == [[]]
    assert "a" not in h._requests  # a left the batch: forgotten


def test_rows_that_sampled_nothing_get_no_draft_and_keep_their_pending_draft():
    h = hybrid(sam={"a": [1, 2]})
    step(h, ["a"], [[3]])
    assert step(h, ["a"], [[]]) == [[]]
    assert h._requests["a"].pending == ("sam", 2)


def test_a_failure_gives_no_drafts_and_is_logged_once(caplog):
    h = hybrid(sam={"a": [1, 2]})
    h.recycling = None  # any failure inside
    batch = SimpleNamespace(req_ids=["a"], req_id_to_index={"a": 0},
                            num_tokens_no_spec=np.array([5]))
    with caplog.at_level(logging.WARNING, logger="vllm.accel.spec_decode"):
        assert h.propose_with_batch(8, batch, [[1]]) == [[]]
        assert h.propose_with_batch(8, batch, [[1]]) == [[]]
    assert sum("HybridProposer failed" in r.getMessage() for r in caplog.records) == 1


def test_unpatched_call_drafts_nothing_and_forwards_logits_to_recycling(caplog):
    h = HybridProposer(make_config())
    with caplog.at_level(logging.WARNING, logger="vllm.accel.spec_decode"):
        assert h.propose([[1], [2]], np.array([3, 3]), None) == [[], []]
        h.propose([[1]], np.array([3]), None)
    assert sum("without the input batch" in r.getMessage() for r in caplog.records) == 1
    import torch

    logits = torch.zeros(1, 300)
    logits[0, 42] = 5.0
    h.observe_target_logits(torch.tensor([7]), logits)
    assert h.recycling.table.successors[7, 0] == 42


def test_real_sources_together():
    """SAM drafts the copied span, recycling the observed successor; both get verified."""
    import torch

    h = HybridProposer(make_config(knobs={"min_match": 2}))
    logits = torch.zeros(1, 300)
    logits[0, 201] = 5.0
    h.observe_target_logits(torch.tensor([200]), logits)
    code = list(range(100, 120))
    seq = code + [7] + code[:5]
    batch = SimpleNamespace(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1},
                            num_tokens_no_spec=np.array([len(seq), 3]),
                            num_prompt_tokens=np.array([21, 2]),
                            token_ids_cpu=np.zeros((2, MAX_LEN), dtype=np.int32))
    batch.token_ids_cpu[0, :len(seq)] = seq
    batch.token_ids_cpu[1, :3] = [1, 2, 200]
    out = h.propose_with_batch(8, batch, [[seq[-1]], [200]])
    assert out[0] == code[5:13] and out[1] == [201]
