"""The composition matrix: complete, consistent with its tests and the README, and enforced."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_accel import composition
from vllm_accel.composition import FEATURES, MATRIX, check_composition, features_of
from vllm_accel.config import AccelConfigError

ROOT = Path(__file__).resolve().parents[3]


def _config(backend=None, cache_dtype="auto", connector=None, proposer=None):
    return SimpleNamespace(
        attention_config=SimpleNamespace(backend=backend and SimpleNamespace(name=backend)),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        kv_transfer_config=connector and SimpleNamespace(kv_connector=connector),
        speculative_config=proposer and SimpleNamespace(model=proposer))


def test_every_pair_has_a_verdict():
    assert set(MATRIX) == {frozenset(p) for p in itertools.combinations(FEATURES, 2)}


def test_every_tested_verdict_names_an_existing_test():
    verdicts = [*MATRIX.values(), composition.FULL_SET_TEST,
                *composition.TENSOR_PARALLEL.values()]
    for verdict in (v for v in verdicts if v.status == "tested"):
        path, _, name = verdict.detail.partition("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), verdict.detail


def test_full_set_is_allowed_and_maximal():
    assert composition.refusal(set(composition.FULL_SET)) is None
    for extra in set(FEATURES) - composition.FULL_SET:
        assert composition.refusal(set(composition.FULL_SET) | {extra}) is not None


def test_features_of_reads_the_flags():
    assert features_of(_config()) == set()
    assert features_of(_config("ACCEL_SPARSE_PREFILL", "kivi_2bit", "ChunkReuseConnector",
                               "vllm_accel.spec_decode.SAMProposer")) == {
        "sparse", "kivi", "reuse", "proposer"}
    assert features_of(_config("FLASH_ATTN", "fp8", "NixlConnector", "ngram")) == set()


@pytest.mark.parametrize("config, flags", [
    (_config("ACCEL_SPEED", connector="ChunkReuseConnector"),
     ("--attention-backend ACCEL_SPEED", "--kv-transfer-config ChunkReuseConnector")),
    (_config("ACCEL_SPARSE_PREFILL", cache_dtype="kivi_4bit"),
     ("--attention-backend ACCEL_SPARSE_PREFILL", "--kv-cache-dtype kivi_4bit|kivi_2bit")),
    (_config(cache_dtype="kivi_2bit", connector="ChunkReuseConnector"),
     ("--kv-cache-dtype", "ChunkReuseConnector")),
])
def test_refused_pairs_fail_naming_both_flags(config, flags):
    with pytest.raises(AccelConfigError) as refused:
        check_composition(config)
    assert all(flag in str(refused.value) for flag in flags), str(refused.value)
    assert "Drop one of the two" in str(refused.value)


def test_features_not_ready_for_several_workers_refuse_them():
    config = _config(cache_dtype="kivi_4bit")
    check_composition(config)  # one worker: fine
    config.parallel_config = SimpleNamespace(tensor_parallel_size=2)
    with pytest.raises(AccelConfigError, match=r"KIVI KV cache\) does not run with "
                                               r"--tensor-parallel-size 2 yet"):
        check_composition(config)
    assert set(composition.TENSOR_PARALLEL) == set(FEATURES)


def test_allowed_pairs_pass():
    check_composition(_config("ACCEL_SPARSE_PREFILL", connector="ChunkReuseConnector",
                              proposer="vllm_accel.spec_decode.HybridProposer"))
    check_composition(_config(cache_dtype="kivi_4bit",
                              proposer="vllm_accel.spec_decode.SAMProposer"))


def test_readme_carries_the_generated_table():
    assert composition.markdown_table() in (ROOT / "README.md").read_text(), (
        "README's composition table is stale: paste vllm_accel.composition.markdown_table()")
