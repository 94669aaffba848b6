"""Quality harness: prompt construction, scoring and the metrics' arithmetic."""

from __future__ import annotations

import math
import random

import pytest

from vllm_accel.quality import identity, needle, perplexity, retrieval
from vllm_accel.quality.prompts import insert_at_depths


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from vllm_accel.quality.prompts import load_tokenizer

    return load_tokenizer(tiny_llama)


def test_insert_at_depths_places_sentences_in_order():
    text = "".join(f"Sentence {i}. " for i in range(100))
    out = insert_at_depths(text, [(0.25, "NEEDLE-A."), (0.75, "NEEDLE-B.")])
    a, b = out.index("NEEDLE-A."), out.index("NEEDLE-B.")
    assert 0.2 < a / len(out) < 0.3 and 0.7 < b / len(out) < 0.8
    assert out.replace("NEEDLE-A. ", "").replace("NEEDLE-B. ", "") == text


def test_needle_cases_cover_grid_and_hide_the_answer(tokenizer):
    cases = needle.build_cases(tokenizer, [300, 600], [0.1, 0.5, 0.9], seed=3)
    assert [(c.length, c.depth) for c in cases] == [
        (n, d) for n in (300, 600) for d in (0.1, 0.5, 0.9)]
    for case in cases:
        text = tokenizer.decode(case.prompt_ids)
        assert f"The special magic number for {case.key} is {case.answer}." in text
        assert abs(len(case.prompt_ids) - case.length) < 0.2 * case.length
    assert needle.score(cases[0], f"It is {cases[0].answer}.") == 1.0
    assert needle.score(cases[0], "I don't know") == 0.0
    again = needle.build_cases(tokenizer, [300, 600], [0.1, 0.5, 0.9], seed=3)
    assert [c.prompt_ids for c in again] == [c.prompt_ids for c in cases]  # deterministic


def test_multivalue_score_is_fractional(tokenizer):
    case = retrieval.build_multivalue(tokenizer, [400], samples=1, num_values=3)[0]
    assert retrieval.score(case, ", ".join(case.answers[:2])) == pytest.approx(2 / 3)
    multikey = retrieval.build_multikey(tokenizer, [400], samples=2, num_keys=4)
    assert all(len(c.answers) == 1 for c in multikey)


def test_perplexity_math():
    assert perplexity.perplexity([[None, math.log(0.5), math.log(0.5)]]) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        perplexity.perplexity([[None]])


def test_prediction_agreement_counts_top1_matches_and_logprob_drift():
    base = [{"logprobs": [None, -1.0, -2.0, -3.0], "top1": [None, 5, 6, 7]}]
    same = perplexity.prediction_agreement(base, base)
    assert same == {"top1_agreement": 1.0, "mean_abs_logprob_delta": 0.0, "positions": 3}
    # a test run that is *more* confident in the prompt tokens still counts as drift
    test = [{"logprobs": [None, -0.5, -2.0, -4.0], "top1": [None, 5, 9, 7]}]
    got = perplexity.prediction_agreement(base, test)
    assert got["top1_agreement"] == pytest.approx(2 / 3)
    assert got["mean_abs_logprob_delta"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="differ in length"):
        perplexity.prediction_agreement(base, [{"logprobs": [None], "top1": [None]}])


def test_heldout_windows_do_not_overlap_the_haystack(tokenizer):
    from vllm_accel.quality import data

    windows = perplexity.build_windows(tokenizer, 64, 3)
    assert len(windows) == 3 and all(len(w) <= 64 for w in windows)
    heldout = set(data.HELDOUT)
    assert heldout <= set(data.essays())
    assert all(data.essays()[name][:200] not in data.haystack_text() for name in heldout)


def test_identity_compare_reports_first_divergence():
    result = identity.compare([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert result == {"identical_fraction": 0.5, "first_divergence": 1, "sequences": 2}
    assert identity.compare([[1]], [[1]])["first_divergence"] == -1
    rng = random.Random(0)
    seqs = [[rng.randrange(10) for _ in range(5)] for _ in range(4)]
    assert identity.compare(seqs, seqs)["identical_fraction"] == 1.0
