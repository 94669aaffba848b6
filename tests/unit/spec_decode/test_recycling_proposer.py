"""Token recycling without an engine: the table, chain drafts, the logits runtime patch, knobs."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_accel.config import AccelConfigError, load_section
from vllm_accel.spec_decode import RecyclingProposer, recycling_proposer
from vllm_accel.spec_decode.recycling_table import RecyclingTable, RecyclingTableError

VOCAB = 50
MAX_LEN = 256


@pytest.fixture(autouse=True)
def no_runtime_patch(monkeypatch):
    """Building the proposer applies the proposer_target_logits patch to vLLM's runner; these
    tests call the hooks directly, so they skip that (and vLLM's 8 s import)."""
    calls = []
    monkeypatch.setattr(recycling_proposer, "_enable_target_logits",
                        lambda: calls.append(1) or True)
    return calls


def make_config(k=8, knobs=None, max_model_len=MAX_LEN, vocab=VOCAB):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        additional_config={"vllm_accel": {"spec_decode": knobs}} if knobs else {},
        model_config=SimpleNamespace(max_model_len=max_model_len, get_vocab_size=lambda: vocab,
                                     tokenizer="unused", tokenizer_revision=None,
                                     trust_remote_code=False))


def logits_favouring(successors: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Input tokens and logits rows whose top tokens are ``successors[token]``, in order."""
    tokens = torch.tensor(list(successors), dtype=torch.int32)
    logits = torch.randn(len(successors), VOCAB) * 0.1
    for row, succ in enumerate(successors.values()):
        for rank, tok in enumerate(succ):
            logits[row, tok] = 10.0 - rank
    return tokens, logits


# ---------------------------------------------------------------------------- the table


def test_update_replaces_rows_and_ignores_out_of_vocab_ids():
    table = RecyclingTable(VOCAB, 3)
    table.update(np.array([5, 7]), np.array([[1, 2, 3], [4, 5, 6]]))
    assert table.successors[5].tolist() == [1, 2, 3] and table.successors[7].tolist() == [4, 5, 6]
    # the newest observation replaces the row; a repeated key: the last row wins
    table.update(np.array([5, 5]), np.array([[9, 8, 7], [10, 11, 12]]))
    assert table.successors[5].tolist() == [10, 11, 12]
    # padded-vocabulary ids become "unseen", keys outside the vocabulary are skipped
    table.update(np.array([6, VOCAB + 3, -1]), np.array([[VOCAB, 2, 1]] * 3))
    assert table.successors[6].tolist() == [-1, 2, 1]
    # narrower top-k than the table: the rest of the row is cleared
    table.update(np.array([7]), np.array([[3]]))
    assert table.successors[7].tolist() == [3, -1, -1]
    assert table.num_seen == 2  # 5 and 7 (6's first successor is unseen)
    with pytest.raises(ValueError, match="topk must be"):
        table.update(np.array([1, 2]), np.array([[1, 2]]))


def test_chain_follows_first_successors_until_an_unseen_token():
    table = RecyclingTable(VOCAB, 2)
    table.update(np.array([1, 2, 3]), np.array([[2, 9], [3, 9], [4, 9]]))
    assert table.chain(1, 10) == [2, 3, 4]  # 4 was never observed: stop
    assert table.chain(1, 2) == [2, 3]
    assert table.chain(4, 5) == [] and table.chain(VOCAB + 1, 5) == []
    table.update(np.array([4]), np.array([[1, 0]]))  # a cycle is followed, up to the length
    assert table.chain(1, 6) == [2, 3, 4, 1, 2, 3]


def test_table_file_roundtrip_and_bad_files(tmp_path):
    table = RecyclingTable(VOCAB, 4)
    table.update(np.array([3]), np.array([[1, 2, 3, 4]]))
    table.save(tmp_path / "t.npy")
    assert RecyclingTable.load(tmp_path / "t.npy", VOCAB, 4).successors[3].tolist() == [1, 2, 3, 4]
    with pytest.raises(RecyclingTableError, match=r"is \[50, 4\] but this model needs \[60, 4\]"):
        RecyclingTable.load(tmp_path / "t.npy", 60, 4)
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(RecyclingTableError, match="not a table file"):
        RecyclingTable.load(tmp_path / "junk.npy", VOCAB, 4)
    np.save(tmp_path / "big.npy", np.full((VOCAB, 4), VOCAB + 5, dtype=np.int32))
    with pytest.raises(RecyclingTableError, match="outside the vocabulary"):
        RecyclingTable.load(tmp_path / "big.npy", VOCAB, 4)


# ---------------------------------------------------------------------------- the proposer


def test_observed_logits_become_chain_drafts(no_runtime_patch):
    p = RecyclingProposer(make_config(k=8, knobs={"recycling_max_draft": 8, "recycling_topk": 3}))
    assert no_runtime_patch == [1]
    assert p.propose([[1]], np.array([10])) == [[]]  # nothing observed yet
    tokens, logits = logits_favouring({1: [2, 7, 8], 2: [3, 7, 8], 3: [4, 1, 8]})
    p.observe_target_logits(tokens, logits)
    assert p.table.successors[1].tolist() == [2, 7, 8]
    assert p.table.successors[3].tolist() == [4, 1, 8]
    # one draft per row, from the last sampled token; rows that sampled nothing get none
    out = p.propose([[9, 1], [], [2]], np.array([10, 10, 10]))
    assert out == [[2, 3, 4], [], [3, 4]]


def test_draft_length_is_capped_by_knob_scheduler_and_model_length():
    chain = {t: [t + 1] for t in range(1, 30)}
    p = RecyclingProposer(make_config(k=8, knobs={"recycling_max_draft": 5}))
    p.observe_target_logits(*logits_favouring(chain))
    assert p.propose([[1]], np.array([10])) == [[2, 3, 4, 5, 6]]  # recycling_max_draft
    batch = SimpleNamespace(num_tokens_no_spec=np.array([10]))
    assert p.propose_with_batch(2, batch, [[1]]) == [[2, 3]]  # the scheduler's budget
    assert p.propose([[1]], np.array([MAX_LEN - 3])) == [[2, 3]]  # the model length
    assert p.propose([[1]], np.array([MAX_LEN - 1])) == [[]]


def test_failures_give_no_drafts_and_are_logged_once(caplog):
    p = RecyclingProposer(make_config())
    p.observe_target_logits(*logits_favouring({1: [2]}))
    p.table = None  # any failure inside
    with caplog.at_level(logging.ERROR, logger="vllm.accel.spec_decode"):
        assert p.propose([[1], [2]], np.array([5, 5])) == [[], []]
        assert p.propose([[1]], np.array([5])) == [[]]
        p.observe_target_logits(torch.tensor([1]), torch.zeros(1, VOCAB))
        p.observe_target_logits(torch.tensor([1]), torch.zeros(1, VOCAB))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("RecyclingProposer failed" in m for m in messages) == 1
    assert sum("could not record" in m for m in messages) == 1


def test_hot_start_loads_and_saves_the_table(tmp_path, monkeypatch):
    saved = []
    monkeypatch.setattr(recycling_proposer.atexit, "register",
                        lambda fn, *args: saved.append((fn, args)))
    path = tmp_path / "table.npy"
    first = RecyclingProposer(make_config(knobs={"recycling_table": str(path)}))
    first.observe_target_logits(*logits_favouring({1: [2], 2: [3]}))
    (fn, args), = saved
    fn(*args)  # what happens when the model runner's process exits
    second = RecyclingProposer(make_config(knobs={"recycling_table": str(path)}))
    assert second.propose([[1]], np.array([5])) == [[2, 3]]
    with pytest.raises(RecyclingTableError, match="recycling_topk"):
        RecyclingProposer(make_config(knobs={"recycling_table": str(path), "recycling_topk": 2}))


@pytest.mark.parametrize("k", [0, 17])
def test_speculative_tokens_out_of_range(k):
    with pytest.raises(ValueError, match=f"num_speculative_tokens={k}.*1 to 16"):
        RecyclingProposer(make_config(k=k))


@pytest.mark.parametrize("knobs, message", [
    ({"recycling_topk": 0}, "recycling_topk=0: must be between 1 and 64"),
    ({"recycling_topk": 65}, "recycling_topk=65"),
    ({"recycling_max_draft": 0}, "recycling_max_draft=0: must be between 1 and 16"),
    ({"recycling_max_draft": 17}, "recycling_max_draft=17"),
    ({"recycling_table": " "}, "recycling_table=' ': must be a file path"),
    ({"hybrid_verify_cost": -0.1}, "hybrid_verify_cost=-0.1: must be >= 0 and < 1"),
    ({"hybrid_verify_cost": 1.0}, "hybrid_verify_cost=1.0"),
    ({"hybrid_ema_weight": 0.0}, "hybrid_ema_weight=0.0: must be > 0 and <= 1"),
    ({"hybrid_ema_weight": 1.5}, "hybrid_ema_weight=1.5"),
    ({"hybrid_probe_every": 0}, "hybrid_probe_every=0: must be >= 1"),
    ({"recycling_topk": "many"}, "recycling_topk='many': expected int"),
])
def test_bad_knobs_name_the_knob(knobs, message):
    with pytest.raises(AccelConfigError, match=f"spec_decode.{message}".replace("(", r"\(")):
        load_section("spec_decode", {"vllm_accel": {"spec_decode": knobs}}, environ={})


def test_knobs_from_the_environment():
    knobs = load_section("spec_decode", {}, environ={
        "VLLM_ACCEL_SPEC_DECODE_RECYCLING_TOPK": "4",
        "VLLM_ACCEL_SPEC_DECODE_HYBRID_VERIFY_COST": "0.05"})
    assert knobs.recycling_topk == 4 and knobs.hybrid_verify_cost == 0.05


# ---------------------------------------------------------------------------- the runtime patch


def test_runtime_patch_shows_the_drafter_each_rows_input_token_and_logits():
    from vllm_accel._patches.proposer_target_logits import _make_replacement

    def original(self, logits, spec_decode_metadata, *args, **kwargs):
        return ("sampled", logits, spec_decode_metadata)

    wrapped = _make_replacement(original)
    seen = []

    class Drafter:
        def observe_target_logits(self, token_ids, logits):
            seen.append((token_ids.tolist(), logits))

    input_ids = torch.tensor([11, 12, 13, 14, 15, 16])
    runner = SimpleNamespace(drafter=Drafter(), input_ids=SimpleNamespace(gpu=input_ids))
    meta = SimpleNamespace(logits_indices=torch.tensor([1, 2, 5]))
    logits = torch.zeros(3, VOCAB)
    assert wrapped(runner, logits, meta) == ("sampled", logits, meta)
    assert seen == [([12, 13, 16], logits)]
    # no speculative-decoding metadata, no logits, or a drafter without the hook: untouched
    assert wrapped(runner, logits, None)[0] == "sampled"
    assert wrapped(runner, None, meta)[0] == "sampled"
    runner.drafter = object()
    assert wrapped(runner, logits, meta)[0] == "sampled"
    del runner.drafter
    assert wrapped(runner, logits, meta)[0] == "sampled"
    assert len(seen) == 1
