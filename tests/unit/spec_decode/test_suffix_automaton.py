"""Suffix automaton (native and pure Python) against a brute-force reference.

Every test runs on both implementations; the native one is skipped with a
reason when ``vllm_accel._C_sam`` was not built.  The reference works on plain
lists: "the match" is the longest suffix of the query that occurs in the text
ending before the text's last position (so at least one token follows it).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_accel.spec_decode import suffix_automaton as public
from vllm_accel.spec_decode.suffix_automaton import available_implementations

IMPLS = available_implementations()
IMPL_NAMES = ["python", "native"]
HYPOTHESIS = settings(max_examples=40, deadline=None)
STRATEGIES = ("recent", "first", "frequent")


def impl_module(name: str):
    if name not in IMPLS:
        pytest.skip(f"native extension not built ({public.NATIVE_UNAVAILABLE_REASON})")
    return IMPLS[name]


def native_or_skip():
    return impl_module("native")


# ----------------------------------------------------------------- reference


def occurrences(text: list[int], pattern: list[int]) -> int:
    m = len(pattern)
    return sum(1 for s in range(len(text) - m + 1) if text[s : s + m] == pattern)


def reference_match(text: list[int], query: list[int]) -> tuple[int, list[int]]:
    """(length, end positions) of the longest suffix of query occurring in text
    and ending before len(text) - 1; (0, []) if none."""
    for length in range(min(len(query), len(text) - 1), 0, -1):
        suffix = query[len(query) - length :]
        ends = [
            e for e in range(length - 1, len(text) - 1) if text[e - length + 1 : e + 1] == suffix
        ]
        if ends:
            return length, ends
    return 0, []


def reference_frequent(
    text: list[int], context: list[int], k: int, min_prob: float
) -> list[int]:
    """Greedy most-frequent continuation (ties: smaller id) with the
    cumulative-probability stop, computed by counting substrings."""
    context, out, prob = list(context), [], 1.0
    while len(out) < k:
        m = len(context)
        followers: dict[int, int] = {}
        for s in range(len(text) - m):
            if text[s : s + m] == context:
                followers[text[s + m]] = followers.get(text[s + m], 0) + 1
        if not followers:
            break
        token = min(followers, key=lambda t: (-followers[t], t))
        prob *= followers[token] / occurrences(text, context)
        if prob < min_prob:
            break
        out.append(token)
        context.append(token)
    return out


def check_against_reference(obj, text, query, k, min_match=1, min_prob=0.0):
    """obj (automaton or matcher) has consumed `query`; its text is `text`."""
    length, ends = reference_match(text, query)
    assert obj.match_len == length
    if length == 0:
        assert obj.match_end == -1
        for strategy in STRATEGIES:
            assert obj.draft(k, strategy=strategy) == []
        return
    # "recent" copies from a genuine earlier occurrence of the match.
    assert obj.match_end in ends
    end = obj.match_end
    assert obj.draft(k, min_match) == (text[end + 1 : end + 1 + k] if length >= min_match else [])
    first = min(ends)
    expected_first = text[first + 1 : first + 1 + k] if length >= min_match else []
    assert obj.draft(k, min_match, "first") == expected_first
    expected_frequent = (
        reference_frequent(text, query[len(query) - length :], k, min_prob)
        if length >= min_match
        else []
    )
    assert obj.draft(k, min_match, "frequent", min_prob) == expected_frequent


token_lists = st.lists(st.integers(0, 3), max_size=36)


# ------------------------------------------------------- growing automaton


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_empty_automaton(impl_name):
    sam = impl_module(impl_name).SuffixAutomaton()
    assert (sam.match_len, sam.match_end, sam.num_states, sam.num_tokens) == (0, -1, 1, 0)
    assert sam.draft(4) == [] and sam.count([]) == 1 and sam.count([1]) == 0
    assert sam.max_states is None and sam.on_full == "rebuild" and not sam.frozen


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_recent_copies_latest_repeat_and_first_the_earliest(impl_name):
    sam = impl_module(impl_name).SuffixAutomaton()
    sam.extend([1, 2, 3, 10, 5, 1, 2, 3, 11, 6, 1, 2, 3])
    assert sam.match_len == 3
    assert sam.draft(2) == [11, 6]
    assert sam.draft(2, strategy="first") == [10, 5]
    assert sam.draft(2, min_match=4) == []
    assert sam.count([1, 2, 3]) == 3 and sam.count([2, 3, 11]) == 1


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_frequent_strategy_and_min_prob(impl_name):
    sam = impl_module(impl_name).SuffixAutomaton()
    sam.extend([7, 1, 7, 1, 7, 1, 7, 2, 9, 7])
    # after 7 (5x): 1 three times; after 7 1 (3x): 7 always; after 7 1 7: 1 twice.
    # Cumulative probabilities: 3/5, 3/5, 2/5.
    assert sam.draft(3, strategy="frequent") == [1, 7, 1]
    assert sam.draft(3, strategy="frequent", min_prob=0.5) == [1, 7]
    assert sam.draft(3, strategy="frequent", min_prob=0.8) == []


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
@HYPOTHESIS
@given(tokens=token_lists, k=st.integers(0, 5), min_match=st.integers(0, 3),
       min_prob=st.sampled_from([0.0, 0.25, 0.6]))
def test_growing_automaton_matches_reference_after_every_token(
    impl_name, tokens, k, min_match, min_prob
):
    sam = impl_module(impl_name).SuffixAutomaton()
    for i, token in enumerate(tokens):
        sam.extend([token])
        prefix = tokens[: i + 1]
        check_against_reference(sam, prefix, prefix, k, min_match, min_prob)
    assert sam.tokens() == tokens and sam.total_tokens == len(tokens)
    # A suffix automaton of n >= 2 tokens has at most 2n - 1 states, 3n - 4 transitions.
    if len(tokens) >= 3:
        assert sam.num_states <= 2 * len(tokens) - 1
        assert sam.num_transitions <= 3 * len(tokens) - 4


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
@HYPOTHESIS
@given(tokens=st.lists(st.integers(0, 2), max_size=30),
       patterns=st.lists(st.lists(st.integers(0, 2), max_size=5), max_size=8))
def test_count_matches_reference(impl_name, tokens, patterns):
    sam = impl_module(impl_name).SuffixAutomaton()
    sam.extend(tokens)
    for pattern in patterns:
        assert sam.count(pattern) == (
            occurrences(tokens, pattern) if pattern else len(tokens) + 1
        )


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
@HYPOTHESIS
@given(tokens=token_lists, cuts=st.lists(st.integers(0, 36), max_size=6))
def test_batch_extend_equals_incremental(impl_name, tokens, cuts, tmp_path_factory):
    module = impl_module(impl_name)
    one_by_one, chunked = module.SuffixAutomaton(), module.SuffixAutomaton()
    for token in tokens:
        one_by_one.extend([token])
    bounds = [0, *sorted(c for c in cuts if c <= len(tokens)), len(tokens)]
    for lo, hi in zip(bounds, bounds[1:]):
        chunked.extend(tokens[lo:hi])
    for attr in ("match_len", "match_end", "num_states", "num_transitions", "num_tokens"):
        assert getattr(one_by_one, attr) == getattr(chunked, attr)
    for strategy in STRATEGIES:
        assert one_by_one.draft(4, strategy=strategy) == chunked.draft(4, strategy=strategy)
    folder = tmp_path_factory.mktemp("sam")
    one_by_one.save(folder / "a.sam")
    chunked.save(folder / "b.sam")
    assert (folder / "a.sam").read_bytes() == (folder / "b.sam").read_bytes()


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_large_and_negative_token_ids(impl_name):
    big = [199_999, 2**31 - 1, -(2**31), 150_000, 3]
    tokens = big + [0] + big[:3] + [7] + big[:4]
    sam = impl_module(impl_name).SuffixAutomaton()
    sam.extend(tokens)
    check_against_reference(sam, tokens, tokens, k=4)
    # The 4-token suffix only occurred at the start; its 3-token suffix also before 7.
    assert sam.match_len == 4 and sam.draft(2) == [3, 0]


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_accepts_numpy_and_array_inputs(impl_name):
    module = impl_module(impl_name)
    tokens = [5, 6, 5, 6, 5, 9, 5, 6]
    reference = module.SuffixAutomaton()
    reference.extend(tokens)
    for batch in (np.array(tokens, np.int32), np.array(tokens, np.int64),
                  np.array(tokens, np.int64)[::-1][::-1], tuple(tokens), iter(tokens)):
        sam = module.SuffixAutomaton()
        sam.extend(batch)
        assert (sam.match_len, sam.draft(3), sam.tokens()) == (
            reference.match_len, reference.draft(3), reference.tokens())


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_invalid_arguments(impl_name):
    module = impl_module(impl_name)
    for bad in (0, -1, 8):
        with pytest.raises(ValueError):
            module.SuffixAutomaton(max_states=bad)
    with pytest.raises(ValueError):
        module.SuffixAutomaton(on_full="grow")
    sam = module.SuffixAutomaton()
    sam.extend([1, 2, 1])
    with pytest.raises(ValueError, match="strategy"):
        sam.draft(2, strategy="best")
    with pytest.raises(ValueError, match="int32"):
        sam.extend([2**31])
    with pytest.raises(ValueError, match="int32"):
        sam.extend(np.array([-(2**31) - 1], np.int64))
    with pytest.raises(TypeError):
        sam.extend([1.5])
    with pytest.raises(ValueError, match="frozen"):
        sam.matcher()
    assert sam.tokens() == [1, 2, 1]  # failed calls appended nothing


# ------------------------------------------------------------ memory bound


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_freeze_on_full_keeps_matching_against_frozen_text(impl_name):
    rng = random.Random(3)
    tokens = [rng.randrange(3) for _ in range(160)]
    sam = impl_module(impl_name).SuffixAutomaton(max_states=24, on_full="freeze")
    for i, token in enumerate(tokens):
        sam.extend([token])
        assert sam.num_states <= 24
        text = sam.tokens()
        if sam.frozen:
            check_against_reference(sam, text, tokens[: i + 1], k=3)
        else:
            assert text == tokens[: i + 1]
    assert sam.frozen and sam.num_tokens < len(tokens) and sam.total_tokens == len(tokens)
    assert sam.tokens() == tokens[: sam.num_tokens]


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_rebuild_on_full_keeps_recent_window(impl_name):
    rng = random.Random(4)
    tokens = [rng.randrange(4) for _ in range(400)]
    sam = impl_module(impl_name).SuffixAutomaton(max_states=40)
    for i, token in enumerate(tokens):
        sam.extend([token])
        assert sam.num_states <= 40
        text = sam.tokens()
        assert text == tokens[i + 1 - len(text) : i + 1]  # a suffix of everything seen
        check_against_reference(sam, text, text, k=3)
    assert sam.num_rebuilds > 10 and not sam.frozen and sam.total_tokens == len(tokens)


def test_native_memory_stays_bounded():
    module = native_or_skip()
    rng = random.Random(5)
    sam = module.SuffixAutomaton(max_states=4096)
    sizes = []
    for _ in range(40):
        sam.extend([rng.randrange(50_000) for _ in range(2500)])
        assert sam.num_states <= 4096
        sizes.append(sam.memory_bytes())
    assert max(sizes[5:]) == sizes[5]  # capacity stops growing once the bound is reached
    assert sizes[-1] < 4096 * 200


# ---------------------------------------------------- static (corpus) use


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
@HYPOTHESIS
@given(corpus=token_lists, queries=st.lists(token_lists, min_size=1, max_size=3),
       k=st.integers(1, 5), min_prob=st.sampled_from([0.0, 0.4]))
def test_matcher_matches_reference(impl_name, corpus, queries, k, min_prob):
    sam = impl_module(impl_name).SuffixAutomaton()
    sam.extend(corpus)
    sam.freeze()
    matcher = sam.matcher()
    for query in queries:
        matcher.reset()
        for i, token in enumerate(query):
            matcher.feed([token])
            check_against_reference(matcher, corpus, query[: i + 1], k, min_prob=min_prob)


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_independent_matchers_share_one_automaton(impl_name):
    module = impl_module(impl_name)
    sam = module.SuffixAutomaton()
    sam.extend([1, 2, 3, 4, 5, 1, 2, 6])
    sam.freeze()
    a, b = module.SuffixAutomatonMatcher(sam), sam.matcher()
    a.feed([9, 3])
    b.feed([1, 2])
    assert (a.match_len, a.draft(2)) == (1, [4, 5])
    assert b.match_len == 2 and b.draft(1) in ([3], [6])
    sam.extend([3, 4])  # frozen: only its own cursor moves
    assert sam.tokens() == [1, 2, 3, 4, 5, 1, 2, 6] and sam.match_len == 2


# ------------------------------------------------------------------ files


def _build(module, tokens):
    sam = module.SuffixAutomaton()
    sam.extend(tokens)
    return sam


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_save_load_roundtrip(impl_name, tmp_path):
    module = impl_module(impl_name)
    rng = random.Random(6)
    corpus = [rng.randrange(6) for _ in range(300)]
    sam = _build(module, corpus)
    sam.save(tmp_path / "corpus.sam")
    loaded = module.SuffixAutomaton.load(str(tmp_path / "corpus.sam"))
    assert loaded.frozen and loaded.tokens() == corpus
    assert (loaded.num_states, loaded.num_transitions) == (sam.num_states, sam.num_transitions)
    sam.freeze()
    query = [rng.randrange(6) for _ in range(50)]
    m1, m2 = sam.matcher(), loaded.matcher()
    for token in query:
        m1.feed([token])
        m2.feed([token])
        for strategy in STRATEGIES:
            assert m1.draft(5, strategy=strategy) == m2.draft(5, strategy=strategy)
    check_against_reference(m2, corpus, query, k=5)
    loaded.save(tmp_path / "again.sam")
    assert (tmp_path / "again.sam").read_bytes() == (tmp_path / "corpus.sam").read_bytes()


def test_files_are_identical_across_implementations(tmp_path):
    native = native_or_skip()
    python = IMPLS["python"]
    tokens = [random.Random(7).randrange(5) for _ in range(200)]
    _build(native, tokens).save(tmp_path / "n.sam")
    _build(python, tokens).save(tmp_path / "p.sam")
    assert (tmp_path / "n.sam").read_bytes() == (tmp_path / "p.sam").read_bytes()
    assert python.SuffixAutomaton.load(tmp_path / "n.sam").tokens() == tokens
    assert native.SuffixAutomaton.load(tmp_path / "p.sam").tokens() == tokens


def _rewrite(path, mutate):
    """Apply mutate to the body (everything but the CRC) and re-sign it."""
    data = bytearray(path.read_bytes()[:-4])
    mutate(data)
    path.write_bytes(bytes(data) + zlib.crc32(bytes(data)).to_bytes(4, "little"))


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_corrupt_files_raise_clear_errors(impl_name, tmp_path):
    module = impl_module(impl_name)
    good = tmp_path / "good.sam"
    _build(module, [1, 2, 3, 1, 2, 4]).save(good)
    data = good.read_bytes()

    def load_fails(content: bytes, match: str):
        path = tmp_path / "bad.sam"
        path.write_bytes(content)
        with pytest.raises(module.SAMFormatError, match=match) as info:
            module.SuffixAutomaton.load(path)
        assert isinstance(info.value, ValueError)

    load_fails(b"", "bad magic")
    load_fails(b"NOTASAM!" + data[8:], "bad magic")
    load_fails(data[:-1], "size mismatch")
    load_fails(data + b"\0", "size mismatch")
    flipped = bytearray(data)
    flipped[60] ^= 0x01
    load_fails(bytes(flipped), "checksum")

    resigned = tmp_path / "resigned.sam"
    resigned.write_bytes(data)
    _rewrite(resigned, lambda d: d.__setitem__(slice(8, 12), (2).to_bytes(4, "little")))
    load_fails(resigned.read_bytes(), "version 2")
    resigned.write_bytes(data)
    # First link entry after the text and len arrays: state 0's link (-1) -> 5.
    n_tokens, n_states = 6, int.from_bytes(data[24:32], "little")
    link0 = 40 + 4 * (n_tokens + n_states)
    _rewrite(resigned, lambda d: d.__setitem__(slice(link0, link0 + 4), (5).to_bytes(4, "little")))
    load_fails(resigned.read_bytes(), "inconsistent")

    with pytest.raises(OSError):
        module.SuffixAutomaton.load(tmp_path / "missing.sam")


# -------------------------------------------------- implementations agree


def observable_state(sam) -> tuple:
    return (sam.match_len, sam.match_end, sam.num_states, sam.num_transitions,
            sam.num_tokens, sam.total_tokens, sam.frozen, sam.num_rebuilds)


def test_native_and_python_agree_on_everything(tmp_path):
    native = native_or_skip()
    python = IMPLS["python"]
    rng = random.Random(8)
    for trial in range(60):
        alphabet = rng.choice([2, 3, 5, 1000])
        max_states = rng.choice([None, 16, 40, 100])
        on_full = rng.choice(["rebuild", "freeze"])
        a = python.SuffixAutomaton(max_states, on_full)
        b = native.SuffixAutomaton(max_states, on_full)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(250))]
        i = 0
        while i < len(tokens):
            j = i + rng.randint(1, 6)
            a.extend(tokens[i:j])
            b.extend(tokens[i:j])
            i = j
            assert observable_state(a) == observable_state(b), trial
            for strategy in STRATEGIES:
                k, min_prob = rng.randint(0, 6), rng.choice([0.0, 0.3])
                assert a.draft(k, 1, strategy, min_prob) == b.draft(k, 1, strategy, min_prob)
        a.save(tmp_path / "a.sam")
        b.save(tmp_path / "b.sam")
        assert (tmp_path / "a.sam").read_bytes() == (tmp_path / "b.sam").read_bytes()


# ----------------------------------------------------------- public module


def test_public_module_selects_an_implementation():
    assert public.IMPLEMENTATION in ("native", "python")
    assert public.NATIVE_AVAILABLE == (public.IMPLEMENTATION == "native")
    module = IMPLS[public.IMPLEMENTATION]
    assert public.SuffixAutomaton is module.SuffixAutomaton
    assert issubclass(public.SAMFormatError, ValueError)
    assert (public.NATIVE_UNAVAILABLE_REASON is None) == public.NATIVE_AVAILABLE


def test_force_python_env_and_no_vllm_import():
    code = (
        "import sys\n"
        "from vllm_accel.spec_decode import suffix_automaton as s\n"
        "assert 'vllm' not in sys.modules, 'imported vllm'\n"
        "print(s.IMPLEMENTATION, s.NATIVE_AVAILABLE, type(s.SuffixAutomaton()).__module__)\n"
    )
    env = dict(os.environ, VLLM_ACCEL_SAM_FORCE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["python", "False", "vllm_accel.spec_decode._sam_python"]
