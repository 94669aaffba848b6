"""Which vllm_accel features run together in one engine: the composition matrix.

:data:`FEATURES` are the switchable features and how an engine's config turns each on;
:data:`MATRIX` gives every pair a verdict: ``tested`` (an end-to-end test checks the output of
the pair against the single features' output; the test is named) or ``refused`` (start-up
error; the reason). :func:`check_composition` raises :class:`~vllm_accel.config.AccelConfigError`
for a refused pair, naming both flags and why, and for a feature that does not run under tensor
parallelism yet (:data:`TENSOR_PARALLEL`); it runs where every engine selects its attention
backend (the ``kv_cache_dtype_backend`` patch), before weights load. :func:`markdown_table`
renders the README's table (a unit test keeps the README in step with this file).

No vLLM import: the config is read through attributes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from vllm_accel.config import AccelConfigError


@dataclass(frozen=True)
class Feature:
    name: str
    flag: str


FEATURES: dict[str, Feature] = {
    "speed": Feature("SPEED", "--attention-backend ACCEL_SPEED"),
    "sparse": Feature("sparse prefill", "--attention-backend ACCEL_SPARSE_PREFILL"),
    "kivi": Feature("KIVI KV cache", "--kv-cache-dtype kivi_4bit|kivi_2bit"),
    "reuse": Feature("chunk reuse", "--kv-transfer-config ChunkReuseConnector"),
    "proposer": Feature("vllm_accel proposer",
                        "--speculative-config vllm_accel.spec_decode.*Proposer"),
}

COMPOSITION_TESTS = "tests/integration/test_composition.py"
TENSOR_PARALLEL_TESTS = "tests/integration/test_tensor_parallel.py"


@dataclass(frozen=True)
class Verdict:
    status: str  # "tested" | "refused" | "exclusive"
    detail: str  # the test that checks it, or why it is refused


def _tested(test: str, where: str = COMPOSITION_TESTS) -> Verdict:
    return Verdict("tested", f"{where}::{test}")


_KIVI_PAGES = ("KIVI pages are written and read only by the ACCEL_KIVI_* backend, which "
               "--kv-cache-dtype kivi_* selects itself")
MATRIX: dict[frozenset[str], Verdict] = {
    frozenset(("speed", "sparse")): Verdict("exclusive", "both are --attention-backend values"),
    frozenset(("speed", "kivi")): Verdict("refused", _KIVI_PAGES),
    frozenset(("speed", "reuse")): Verdict(
        "refused", "SPEED's upper layers keep no prompt KV, and the connector loads and "
        "recomputes chunks in every layer; not implemented together yet"),
    frozenset(("speed", "proposer")): Verdict(
        "refused", "verifying drafts runs several decode tokens per step through SPEED's upper "
        "layers; not implemented together yet"),
    frozenset(("sparse", "kivi")): Verdict("refused", _KIVI_PAGES),
    frozenset(("sparse", "reuse")): _tested("test_sparse_prefill_with_chunk_reuse"),
    frozenset(("sparse", "proposer")): _tested("test_sparse_prefill_chunk_reuse_and_proposer"),
    frozenset(("kivi", "reuse")): Verdict(
        "refused", "the connector stores and writes unquantized KV"),
    frozenset(("kivi", "proposer")): _tested("test_kivi_with_proposer"),
    frozenset(("reuse", "proposer")): _tested("test_chunk_reuse_with_proposer"),
}
FULL_SET = frozenset(("sparse", "reuse", "proposer"))
FULL_SET_TEST = _tested("test_sparse_prefill_chunk_reuse_and_proposer")
# Each feature under vLLM's tensor parallelism (--tensor-parallel-size 2 on the CPU).
TENSOR_PARALLEL: dict[str, Verdict] = {
    "speed": _tested("test_speed_matches_one_worker", TENSOR_PARALLEL_TESTS),
    "sparse": _tested("test_sparse_prefill_and_proposer_match_one_worker", TENSOR_PARALLEL_TESTS),
    "kivi": Verdict("refused", "not verified with several workers yet (each worker's share of "
                    "the residual pool is untested)"),
    "reuse": Verdict("refused", "chunk KV is stored per worker, and workers would save and load "
                     "different head shards under one key"),
    "proposer": _tested("test_sparse_prefill_and_proposer_match_one_worker",
                        TENSOR_PARALLEL_TESTS),
}


def features_of(vllm_config: Any) -> set[str]:
    """The vllm_accel features an engine config turns on."""
    on = set()
    backend = getattr(getattr(getattr(vllm_config, "attention_config", None), "backend", None),
                      "name", None)
    if backend == "ACCEL_SPEED":
        on.add("speed")
    elif backend == "ACCEL_SPARSE_PREFILL":
        on.add("sparse")
    cache_config = getattr(vllm_config, "cache_config", None)
    if str(getattr(cache_config, "cache_dtype", "")).startswith("kivi_"):
        on.add("kivi")
    kv_transfer = getattr(vllm_config, "kv_transfer_config", None)
    if getattr(kv_transfer, "kv_connector", None) == "ChunkReuseConnector":
        on.add("reuse")
    speculative = getattr(vllm_config, "speculative_config", None)
    if str(getattr(speculative, "model", None) or "").startswith("vllm_accel.spec_decode."):
        on.add("proposer")
    return on


def refusal(features: set[str]) -> str | None:
    """The start-up error for a set of features, or None when they may run together."""
    for pair in itertools.combinations(sorted(features, key=list(FEATURES).index), 2):
        verdict = MATRIX[frozenset(pair)]
        if verdict.status == "refused":
            a, b = (FEATURES[f] for f in pair)
            return (f"vllm_accel: {a.flag} ({a.name}) cannot be combined with {b.flag} "
                    f"({b.name}): {verdict.detail}. Drop one of the two.")
    return None


def tensor_parallel_refusal(features: set[str], tensor_parallel_size: int) -> str | None:
    """The start-up error for features that do not run with several workers yet, or None."""
    if tensor_parallel_size <= 1:
        return None
    for name in (f for f in FEATURES if f in features):
        verdict = TENSOR_PARALLEL[name]
        if verdict.status == "refused":
            feature = FEATURES[name]
            return (f"vllm_accel: {feature.flag} ({feature.name}) does not run with "
                    f"--tensor-parallel-size {tensor_parallel_size} yet: {verdict.detail}. "
                    f"Use --tensor-parallel-size 1.")
    return None


def check_composition(vllm_config: Any) -> None:
    """Raise :class:`AccelConfigError` when the engine combines features that are refused, or
    runs a feature under tensor parallelism that does not support it yet."""
    features = features_of(vllm_config)
    tensor_parallel_size = getattr(getattr(vllm_config, "parallel_config", None),
                                   "tensor_parallel_size", 1)
    message = refusal(features) or tensor_parallel_refusal(features, tensor_parallel_size)
    if message:
        raise AccelConfigError(message)


def markdown_table() -> str:
    """The composition matrix as a Markdown table (README), with a last row for
    ``--tensor-parallel-size 2``."""
    names = list(FEATURES)
    cell = {"tested": "tested", "refused": "refused at start-up", "exclusive": "one flag"}
    rows = ["| | " + " | ".join(FEATURES[n].name for n in names) + " |",
            "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = ["—" if a == b else cell[MATRIX[frozenset((a, b))].status] for b in names]
        rows.append(f"| {FEATURES[a].name} | " + " | ".join(cells) + " |")
    rows.append("| *--tensor-parallel-size 2* | "
                + " | ".join(cell[TENSOR_PARALLEL[n].status] for n in names) + " |")
    return "\n".join(rows)
