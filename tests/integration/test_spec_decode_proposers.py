"""RecyclingProposer and HybridProposer inside real vLLM CPU engines, on the tiny random model.

* Greedy: output token-identical to no speculation, and drafts really proposed and verified.
* Random sampling (temperature 1.0, top-k 4, see ``TOP_P`` for the top-p): vLLM's rejection
  sampler must keep the output distribution. Many samples of one prompt, with and without a
  proposer, are compared with a chi-square test of homogeneity on consecutive token pairs;
  the same test must reject a deliberately different sampler (temperature 0.5), so it has the
  power to catch a wrong one.

One engine per configuration (no speculation, recycling, hybrid), each in its own process and
each running every task, so the module starts three engines in all. Engines run in float32
(see tests/integration/test_spec_decode.py for why).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from vllm_accel.bench.harness import engine_settings
from vllm_accel.cpu_env import engine_env
from vllm_accel.quality.prompts import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
CLASSES = {"recycling": "vllm_accel.spec_decode.RecyclingProposer",
           "hybrid": "vllm_accel.spec_decode.HybridProposer"}
K = 4
SAMPLES = 400  # requests of the sampling prompt per temperature
SAMPLE_TOKENS = 4
TOP_K = 4
#: Top-p of 0.9999 on top of top-k 4 changes nothing in the distribution (the tokens past the
#: top 4 are already masked) but takes vLLM's sorting top-k/top-p path. The top-k-only path on
#: the CPU (vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_only) calls ``k.max()`` on an
#: empty tensor, and so kills the engine, on every step where no request of the batch has a
#: draft to verify (a prefill, for one), whatever the speculative method: a vLLM 0.32 bug.
#: (The other CPU bug on this path, uninitialised per-draft-token temperature / top-k / top-p,
#: is what the ``cpu_rejection_expand`` runtime patch fixes; the proposers apply it.)
TOP_P = 0.9999
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3,
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
         "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 " * 2]
SAMPLING_TEXT = "Attention is all you need. Keys, values and queries; blocks, pages"


# ---------------------------------------------------------------------------- engine process


def _worker(spec_path: str, out_path: str) -> None:
    """In a fresh process: one engine, greedy then sampling tasks, results as JSON."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_accel.bench import engine_worker as ew

    spec = json.loads(Path(spec_path).read_text())
    engine = LLMEngine.from_engine_args(EngineArgs(**spec["engine"], disable_log_stats=False),
                                        stat_loggers=[ew._stat_logger_factory()])
    result: dict[str, Any] = {"spec": {}}

    def run(name: str, prompts: list[list[int]], params: Any) -> dict[str, dict[str, Any]]:
        before = dict(ew._SPEC)
        records, _ = ew._run(engine, prompts, params)
        result["spec"][name] = {k: ew._SPEC[k] - before[k] for k in ew._SPEC_KEYS}
        return records

    greedy = []
    for ids in spec["greedy_prompts"]:  # one at a time: batch shapes change float rounding
        records = run(f"greedy-{len(greedy)}", [ids],
                      SamplingParams(max_tokens=spec["greedy_tokens"], temperature=0.0))
        greedy.append(records["req-0"]["token_ids"])
    result["greedy"] = greedy
    result["samples"] = {}
    for temperature in spec["temperatures"]:
        params = SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=temperature, top_k=TOP_K,
                                top_p=TOP_P, ignore_eos=True)
        records = run(f"sample-{temperature}", [spec["sampling_prompt"]] * SAMPLES, params)
        result["samples"][str(temperature)] = [r["token_ids"] for r in records.values()]
    tmp = out_path + ".tmp"
    Path(tmp).write_text(json.dumps(result))
    Path(tmp).rename(out_path)


def run_engine(label: str, model_dir: str, log_dir: Path, engine: dict[str, Any],
               temperatures: list[float]) -> dict[str, Any]:
    tok = load_tokenizer(model_dir)
    spec = {"engine": engine_settings(model_dir, 2048, 0.2, {"dtype": "float32", **engine}),
            "greedy_prompts": [tok(t)["input_ids"] for t in TEXTS], "greedy_tokens": 32,
            "sampling_prompt": tok(SAMPLING_TEXT)["input_ids"], "temperatures": temperatures}
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{label}.log"
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        with log_path.open("w") as log:
            proc = subprocess.run([sys.executable, "-m", __name__, str(spec_path), str(out_path)],
                                  stdout=log, stderr=subprocess.STDOUT, env=engine_env(),
                                  cwd=REPO, timeout=600)
        if proc.returncode != 0 or not out_path.exists():
            tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-30:])
            raise AssertionError(f"{label} engine failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(out_path.read_text())
    result["log"] = log_path.read_text(errors="replace")
    return result


def proposer_engine(label: str) -> dict[str, Any]:
    engine: dict[str, Any] = {"speculative_config": {
        "method": "custom_class", "model": CLASSES[label], "num_speculative_tokens": K}}
    if label == "hybrid":
        # The random model rejects most drafts, so by the sampling task the hybrid has backed
        # off (its purpose); probing every other step keeps drafts flowing through the
        # rejection sampler. Back-off itself is covered by the unit tests.
        engine["additional_config"] = {"vllm_accel": {"spec_decode": {"hybrid_probe_every": 2}}}
    return engine


@pytest.fixture(scope="module")
def engines(tiny_llama, tmp_path_factory):
    """label -> that engine's results, each engine started on first use."""
    log_dir = tmp_path_factory.mktemp("proposer-logs")
    cache: dict[str, Any] = {}

    def get(label: str) -> dict[str, Any]:
        if label not in cache:
            try:
                if label == "no_spec":
                    cache[label] = run_engine(label, tiny_llama, log_dir, {}, [1.0, 0.5])
                else:
                    cache[label] = run_engine(label, tiny_llama, log_dir,
                                              proposer_engine(label), [1.0])
            except AssertionError as exc:  # one failed start, not one per test
                cache[label] = exc
        if isinstance(cache[label], Exception):
            raise cache[label]
        return cache[label]

    return get


# ---------------------------------------------------------------------------- statistics


def homogeneity_p_value(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> float:
    """p-value of a chi-square test that samples ``a`` and ``b`` (equal sizes) come from one
    categorical distribution. Categories with fewer than 10 observations in both samples
    together are pooled; the chi-square tail uses the Wilson-Hilferty approximation."""
    assert len(a) == len(b)
    ca, cb = Counter(a), Counter(b)
    cells, pooled = [], [0, 0]
    for key in set(ca) | set(cb):
        if ca[key] + cb[key] >= 10:
            cells.append((ca[key], cb[key]))
        else:
            pooled[0] += ca[key]
            pooled[1] += cb[key]
    if sum(pooled):
        cells.append(tuple(pooled))
    df = len(cells) - 1
    if df < 1:
        return 1.0
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)  # equal sample sizes
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def pairs(samples: list[list[int]], position: int) -> list[tuple[int, int]]:
    """(token position - 1, token position) of every sample: ``position`` >= 1 is a token that
    may come from a verified draft (the first output token never does)."""
    return [(s[position - 1], s[position]) for s in samples]


def test_homogeneity_test_on_known_distributions():
    import random

    rng = random.Random(0)
    draw = lambda weights: [(rng.choices(range(4), weights)[0],) for _ in range(SAMPLES)]  # noqa: E731
    same = homogeneity_p_value(draw([4, 3, 2, 1]), draw([4, 3, 2, 1]))
    shifted = homogeneity_p_value(draw([4, 3, 2, 1]), draw([6, 3, 1, 0.5]))
    assert same > 0.01 and shifted < 1e-3


# ---------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("label", list(CLASSES))
def test_greedy_output_identical_and_drafts_verified(engines, label):
    base, spec = engines("no_spec"), engines(label)
    for failure in ("Proposer failed", "could not record", "not applied",
                    "cannot enable per-request", "without the input batch"):
        assert failure not in spec["log"], failure
    assert "(proposer_target_logits; upstream fix" in spec["log"]
    assert "(cpu_rejection_expand; upstream fix" in spec["log"]
    assert spec["greedy"] == base["greedy"]
    drafted = sum(s["num_draft_tokens"] for name, s in spec["spec"].items()
                  if name.startswith("greedy"))
    assert drafted > 0, spec["spec"]
    assert sum(s["num_draft_tokens"] for s in base["spec"].values()) == 0


@pytest.mark.parametrize("label", list(CLASSES))
def test_random_sampling_keeps_the_distribution(engines, label):
    base, spec = engines("no_spec"), engines(label)
    stats = spec["spec"]["sample-1.0"]
    # the sampled tokens really went through draft verification, accepted and rejected
    assert stats["num_accepted_tokens"] > 0, stats
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"], stats
    reference, with_proposer = base["samples"]["1.0"], spec["samples"]["1.0"]
    assert len(with_proposer) == SAMPLES and {len(s) for s in with_proposer} == {SAMPLE_TOKENS}
    for position in range(1, SAMPLE_TOKENS):
        p = homogeneity_p_value(pairs(reference, position), pairs(with_proposer, position))
        assert p > 1e-3, (label, position, p)


def test_the_distribution_test_rejects_a_different_sampler(engines):
    """Temperature 0.5 instead of 1.0 (same engine, same top-k): the test above must notice.
    A sampler that accepted drafts without the rejection step would skew the same way
    (towards each position's most likely token)."""
    base = engines("no_spec")
    hot, cold = base["samples"]["1.0"], base["samples"]["0.5"]
    for position in range(1, SAMPLE_TOKENS):
        p = homogeneity_p_value(pairs(hot, position), pairs(cold, position))
        assert p < 1e-4, (position, p)


if __name__ == "__main__":
    _worker(*sys.argv[1:])
