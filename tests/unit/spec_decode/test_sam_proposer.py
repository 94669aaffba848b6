"""SAMProposer with a fake input batch (no engine), the runtime patch's dispatch, datastores."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_accel import faults
from vllm_accel.config import AccelConfigError
from vllm_accel.spec_decode import SAMProposer, datastore, sam_proposer

MAX_LEN = 256


@pytest.fixture(autouse=True)
def no_runtime_patch(monkeypatch):
    """The proposer applies the proposer_input_batch patch to vLLM's runner when built; these
    tests call propose_with_batch directly, so they skip that (and vLLM's 8 s import)."""
    calls = []
    monkeypatch.setattr(sam_proposer, "_enable_batch_api", lambda: calls.append(1) or True)
    return calls


def make_config(k=8, knobs=None, tokenizer="unused", max_model_len=MAX_LEN):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        additional_config={"vllm_accel": {"spec_decode": knobs}} if knobs else {},
        model_config=SimpleNamespace(max_model_len=max_model_len, tokenizer=tokenizer,
                                     tokenizer_revision=None, trust_remote_code=False))


class FakeBatch:
    """The InputBatch fields SAMProposer reads, for rows of (req_id, tokens, prompt_len)."""

    def __init__(self, rows):
        self.req_ids = [r[0] for r in rows]
        self.req_id_to_index = {r[0]: i for i, r in enumerate(rows)}
        self.num_tokens_no_spec = np.array([len(r[1]) for r in rows], dtype=np.int32)
        self.num_prompt_tokens = np.array([r[2] for r in rows], dtype=np.int32)
        self.token_ids_cpu = np.zeros((max(len(rows), 1), MAX_LEN), dtype=np.int32)
        for i, r in enumerate(rows):
            self.token_ids_cpu[i, :len(r[1])] = r[1]


def step(proposer, rows, k=8, sampled=None):
    sampled = sampled if sampled is not None else [[r[1][-1]] for r in rows]
    return proposer.propose_with_batch(k, FakeBatch(rows), sampled)


CODE = list(range(100, 140))  # 40 distinct tokens: "the function being rewritten"


def test_copies_the_continuation_of_a_repeated_span(no_runtime_patch):
    p = SAMProposer(make_config(k=8))
    assert no_runtime_patch == [1]
    seq = CODE + [7, 7] + CODE[:10]  # the answer starts re-emitting the code
    assert step(p, [("a", seq, 42)]) == [CODE[10:18]]


def test_no_draft_below_min_match_and_longer_matches_draft_longer():
    p = SAMProposer(make_config(k=8, knobs={"min_match": 3, "length_factor": 1.0}))
    prompt = CODE + [7]
    assert step(p, [("a", prompt + CODE[:2], 41)]) == [[]]  # a 2-token match: no draft
    assert step(p, [("a", prompt + CODE[:3], 41)]) == [CODE[3:6]]  # 3 tokens -> 3
    assert step(p, [("a", prompt + CODE[:5], 41)]) == [CODE[5:10]]  # 5 tokens -> 5
    assert step(p, [("a", prompt + CODE[:20], 41)]) == [CODE[20:28]]  # capped at K


def test_budget_follows_scheduler_and_model_length():
    p = SAMProposer(make_config(k=8))
    seq = CODE + [7] + CODE[:20]
    assert step(p, [("a", seq, 41)], k=2) == [CODE[20:22]]
    short = SAMProposer(make_config(k=8, max_model_len=len(seq) + 3))
    assert step(short, [("a", seq, 41)]) == [CODE[20:22]]
    full = SAMProposer(make_config(k=8, max_model_len=len(seq)))
    assert step(full, [("a", seq, 41)]) == [[]]


def test_rows_that_sampled_nothing_get_no_draft():
    p = SAMProposer(make_config())
    seq = CODE + [7] + CODE[:10]
    rows = [("prefilling", CODE[:30], 30), ("a", seq, 41)]
    assert step(p, rows, sampled=[[], [seq[-1]]]) == [[], CODE[10:18]]


def test_state_is_extended_incrementally_per_request():
    p = SAMProposer(make_config())
    seq = CODE + [7]
    for n in range(len(seq) - 5, len(seq) + 1):
        step(p, [("a", seq[:n], 20)])
    state = p._requests["a"]
    assert state.automaton.num_tokens == len(seq) == state.num_fed


def test_rows_reordered_and_removed_follow_the_request_id():
    p = SAMProposer(make_config(knobs={"length_factor": 1.0}))
    a = CODE + [1] + CODE[:6]
    b = [5, 6, 7, 8, 9, 10, 11, 2, 5, 6, 7]
    assert step(p, [("a", a, 41), ("b", b, 7)]) == [CODE[6:12], [8, 9, 10]]
    # the batch is condensed and reordered; each request keeps its own automaton
    assert step(p, [("b", b + [8], 7), ("a", a + [CODE[6]], 41)]) == [[9, 10, 11, 2], CODE[7:14]]
    assert p._requests["a"].automaton.num_tokens == len(a) + 1
    step(p, [("b", b + [8, 9], 7)])  # "a" finished
    assert set(p._requests) == {"b"}


def test_a_reused_request_id_starts_a_new_automaton():
    p = SAMProposer(make_config(knobs={"length_factor": 1.0}))
    step(p, [("r", CODE + [1] + CODE[:6], 41)])
    other = [9, 8, 7, 6, 5, 9, 8, 7]
    assert step(p, [("r", other, 5)]) == [[6, 5, 9]]
    assert p._requests["r"].automaton.num_tokens == len(other)


def test_a_failure_gives_no_drafts_and_is_logged_once(caplog):
    p = SAMProposer(make_config())
    faults.take_increments()
    seq = CODE + [7] + CODE[:10]

    def boom(*args):
        raise RuntimeError("boom")

    p._update = boom
    with caplog.at_level(logging.ERROR, logger="vllm.accel.spec_decode"):
        assert step(p, [("a", seq, 41), ("b", seq, 41)]) == [[], []]
        assert step(p, [("a", seq, 41)]) == [[]]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert faults.take_increments() == {"proposer_errors": 2}  # every failure is counted
    del p._update  # the failure goes away: the next step drafts again
    assert step(p, [("a", seq, 41)]) == [CODE[10:18]]


def test_unpatched_call_drafts_nothing_and_warns_once(caplog):
    p = SAMProposer(make_config())
    with caplog.at_level(logging.WARNING, logger="vllm.accel.spec_decode"):
        assert p.propose([[1], []], np.zeros(2), np.zeros((2, 4))) == [[], []]
        assert p.propose([[1]], np.zeros(1), np.zeros((1, 4))) == [[]]
    assert sum("without the input batch" in r.getMessage() for r in caplog.records) == 1
    assert p.load_model(object()) is None


@pytest.mark.parametrize("k", [0, 17])
def test_speculative_tokens_out_of_range(k):
    with pytest.raises(ValueError, match=r"num_speculative_tokens=\d+: .* 1 to 16"):
        SAMProposer(make_config(k=k))


@pytest.mark.parametrize("knobs, message", [
    ({"strategy": "best"}, r"spec_decode\.strategy='best': choose one of recent, first"),
    ({"min_match": 0}, r"spec_decode\.min_match=0: must be >= 1"),
    ({"max_states": 10}, r"spec_decode\.max_states=10: must be >= 1024"),
])
def test_bad_knobs_name_the_knob(knobs, message):
    with pytest.raises(AccelConfigError, match=message):
        SAMProposer(make_config(knobs=knobs))


# ---------------------------------------------------------------------------- patch dispatch


def test_runtime_patch_routes_custom_class_proposers_with_the_batch():
    from vllm_accel._patches.proposer_input_batch import _make_replacement

    def original(self, scheduler_output, sampled, *args, **kwargs):
        return "original"

    wrapped = _make_replacement(original)
    batch = object()

    class Drafter:
        def propose_with_batch(self, k, input_batch, sampled):
            assert input_batch is batch
            return [[k]] * len(sampled)

    runner = SimpleNamespace(speculative_config=SimpleNamespace(method="custom_class"),
                             drafter=Drafter(), input_batch=batch, _draft_probs="stale",
                             _draft_prob_req_ids="stale")
    out = SimpleNamespace(num_spec_tokens_to_schedule=3)
    assert wrapped(runner, out, [[1], [2]], None, None, None, None, None, None, None) == [[3]] * 2
    assert runner._draft_probs is None and runner._draft_prob_req_ids is None
    runner.drafter = object()  # no propose_with_batch: vLLM's own call
    assert wrapped(runner, out, [[1]], None) == "original"
    runner.drafter = Drafter()
    runner.speculative_config.method = "ngram"
    assert wrapped(runner, out, [[1]], None) == "original"


# ---------------------------------------------------------------------------- datastores


def _tokenizer(text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


CORPUS = ("def area(width, height):\n    return width * height\n\n"
          "def perimeter(width, height):\n    return 2 * (width + height)\n")


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer(CORPUS * 3)


@pytest.fixture
def store(tmp_path, tokenizer):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "geometry.py").write_text(CORPUS)
    (tmp_path / "corpus" / "notes.txt").write_text("Width times height is the area.\n")
    (tmp_path / "corpus" / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
    built = datastore.build(tokenizer, [tmp_path / "corpus"], tmp_path / "ds" / "code.sam")
    tokenizer.save_pretrained(tmp_path / "tok")
    return built


def test_datastore_roundtrip_and_manifest(store, tokenizer):
    assert store.num_documents == 2 and store.skipped[0].endswith("blob.bin")
    manifest = datastore.read_manifest(store.out)
    assert manifest["tokenizer"].matches(datastore.tokenizer_identity(tokenizer))
    assert manifest["num_tokens"] == store.num_tokens
    sam = datastore.load(store.out, datastore.tokenizer_identity(tokenizer))
    assert sam.frozen and sam.num_tokens == store.num_tokens
    ids = tokenizer(CORPUS, add_special_tokens=False)["input_ids"]
    assert sam.count(ids) == 1


def test_proposer_drafts_from_the_datastore(store, tokenizer, tmp_path):
    p = SAMProposer(make_config(knobs={"datastore": str(store.out)},
                                tokenizer=str(tmp_path / "tok")))
    ids = tokenizer(CORPUS, add_special_tokens=False)["input_ids"]
    cut = len(ids) // 2
    prompt = tokenizer("Write a perimeter helper.\n", add_special_tokens=False)["input_ids"]
    draft = step(p, [("a", prompt + ids[:cut], len(prompt))])[0]
    assert draft and draft == ids[cut:cut + len(draft)]


def test_datastore_for_another_tokenizer_is_refused(store, tmp_path):
    other = _tokenizer("Completely different text, other merges. " * 5)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=r"spec_decode\.datastore=.* was built for tokenizer .*"
                       r"differs .*rebuild it with `vllm-accel datastore build --model"):
        SAMProposer(make_config(knobs={"datastore": str(store.out)},
                                tokenizer=str(tmp_path / "other")))


def test_missing_or_corrupt_datastore_is_one_clear_error(store, tokenizer, tmp_path):
    identity = datastore.tokenizer_identity(tokenizer)
    with pytest.raises(datastore.DatastoreError, match=r"datastore='.*nope\.sam': no such file"):
        datastore.load(tmp_path / "nope.sam", identity)
    data = store.out.read_bytes()
    store.out.write_bytes(data[: len(data) // 2])
    with pytest.raises(datastore.DatastoreError, match="does not match its manifest"):
        datastore.load(store.out, identity)
    store.manifest.write_text("{not json")
    with pytest.raises(datastore.DatastoreError, match="unreadable manifest"):
        datastore.load(store.out, identity)
    store.manifest.unlink()
    with pytest.raises(datastore.DatastoreError, match="manifest .* is missing"):
        datastore.load(store.out, identity)
    for error in (datastore.DatastoreError,):
        assert issubclass(error, ValueError)


def test_build_rejects_bad_corpus(tokenizer, tmp_path):
    with pytest.raises(datastore.DatastoreError, match=r"--corpus .*missing: no such file"):
        datastore.build(tokenizer, [tmp_path / "missing"], tmp_path / "x.sam")
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(datastore.DatastoreError, match="not UTF-8 text"):
        datastore.build(tokenizer, [tmp_path / "bin.dat"], tmp_path / "x.sam")


def test_cli_builds_a_datastore(tmp_path, tokenizer, capsys):
    from vllm_accel import cli

    tokenizer.save_pretrained(tmp_path / "tok")
    (tmp_path / "a.py").write_text(CORPUS)
    out = tmp_path / "a.sam"
    assert cli.main(["datastore", "build", "--model", str(tmp_path / "tok"), "--corpus",
                     str(tmp_path / "a.py"), "--out", str(out)]) == 0
    assert out.exists() and datastore.manifest_path(out).exists()
    assert '"datastore": "' in capsys.readouterr().out
    assert cli.main(["datastore", "build", "--model", str(tmp_path / "tok"), "--corpus",
                     str(tmp_path / "none.txt"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--corpus" in err
