"""Micro-benchmarks: native vs pure-Python suffix automaton (pytest-benchmark).

    pytest tests/unit/spec_decode/test_bench_suffix_automaton.py --benchmark-group-by=group

Also run as plain tests (each body once) with ``--benchmark-disable``.  The
token stream mimics generated text: random spans over a 32k vocabulary mixed
with copies of earlier spans, so that matches and drafts actually occur.

Hot loops call draft() positionally: pybind11's keyword-argument path costs
about 1-2 us per call, more than the draft itself.
"""

from __future__ import annotations

import random
from functools import cache

import pytest

from vllm_accel.spec_decode.suffix_automaton import (
    NATIVE_UNAVAILABLE_REASON,
    available_implementations,
)

IMPLS = available_implementations()
IMPL_NAMES = ["python", "native"]
CONTEXT_TOKENS = 100_000
QUERIES = 10_000
DRAFT_K = 8
# Rounds per benchmark (the Python implementation is ~10-30x slower).
ROUNDS = {"python": 3, "native": 10}


def impl_module(name: str):
    if name not in IMPLS:
        pytest.skip(f"native extension not built ({NATIVE_UNAVAILABLE_REASON})")
    return IMPLS[name]


@cache
def synthetic_tokens(n: int, seed: int = 0, vocab: int = 32_000) -> tuple[int, ...]:
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.3:  # repeat an earlier span
            start = rng.randrange(len(out))
            out.extend(out[start : start + rng.randint(8, 64)])
        else:
            out.extend(rng.randrange(vocab) for _ in range(rng.randint(8, 64)))
    return tuple(out[:n])


def stream() -> tuple[list[int], list[int]]:
    """(context, continuation): the continuation keeps copying from the context."""
    tokens = synthetic_tokens(CONTEXT_TOKENS + QUERIES)
    return list(tokens[:CONTEXT_TOKENS]), list(tokens[CONTEXT_TOKENS:])


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_bench_extend_100k(benchmark, impl_name):
    module = impl_module(impl_name)
    context, _ = stream()
    benchmark.group = "extend 100k tokens"

    def build():
        sam = module.SuffixAutomaton()
        sam.extend(context)
        return sam

    sam = benchmark.pedantic(build, rounds=ROUNDS[impl_name], iterations=1)
    assert sam.num_tokens == CONTEXT_TOKENS and sam.num_states <= 2 * CONTEXT_TOKENS


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_bench_decode_loop_10k(benchmark, impl_name):
    """Per-request automaton: append one token, draft k, 10k times (after 100k)."""
    module = impl_module(impl_name)
    context, continuation = stream()
    benchmark.group = "10k x (extend 1 + draft 8), dynamic"

    def setup():
        sam = module.SuffixAutomaton()
        sam.extend(context)
        return (sam,), {}

    def decode(sam):
        drafted = 0
        for token in continuation:
            sam.extend([token])
            drafted += len(sam.draft(DRAFT_K, 2))
        return drafted

    drafted = benchmark.pedantic(decode, setup=setup, rounds=ROUNDS[impl_name], iterations=1)
    assert drafted > QUERIES // 10  # the stream repeats itself: drafts happen


@cache
def corpus_automaton(impl_name: str):
    sam = IMPLS[impl_name].SuffixAutomaton()
    sam.extend(synthetic_tokens(CONTEXT_TOKENS))
    sam.freeze()
    return sam


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_bench_corpus_match_10k(benchmark, impl_name):
    """Static corpus automaton: feed one token to a matcher, draft k by frequency."""
    impl_module(impl_name)
    matcher = corpus_automaton(impl_name).matcher()
    _, continuation = stream()
    benchmark.group = "10k x (feed 1 + frequent draft 8), static"

    def query():
        matcher.reset()
        drafted = 0
        for token in continuation:
            matcher.feed([token])
            drafted += len(matcher.draft(DRAFT_K, 2, "frequent"))
        return drafted

    drafted = benchmark.pedantic(query, rounds=ROUNDS[impl_name], iterations=1)
    assert drafted > QUERIES // 10
