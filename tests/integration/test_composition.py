"""vllm_accel features combined in one real vLLM CPU engine (SmolLM2): each allowed pair of the
composition matrix (vllm_accel/composition.py) and the largest allowed set, checked token for
token against the single features; one refused pair fails at start-up with the matrix's reason
(all refused pairs: tests/unit/core/test_composition.py).

Prompts: four essay slices marked with the separator, in two orders: the first saves the chunks,
the second reuses them at new offsets. Chunk reuse runs with every claimed token recomputed
(``cacheblend`` at ratio 1.0), whose output is exact, so it can be compared token for token;
its recompute is dense attention, so after reuse the prompt's tokens are those of dense
prefill. Proposers are lossless: adding one must not change a token. Sparse prefill starts at
256 tokens of context so that the ~1.1K-token prompts use it. The KIVI engines and the chunk
reuse + proposer engine split the prompts (chunked prefill: 256-token steps); the sparse ones
do not, because each prefill chunk's last query block is dense by design.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_chunk_reuse import _counter, _reuse
from tests.integration.test_spec_decode import sam_engine
from vllm_accel.bench.harness import BenchError, engine_settings, run_side

pytestmark = pytest.mark.real_model

MAX_TOKENS = 12
SPARSE = {"attention_backend": "ACCEL_SPARSE_PREFILL",
          "additional_config": {"vllm_accel": {"sparse_prefill": {"threshold": 256}}}}
KIVI = {"kv_cache_dtype": "kivi_4bit"}  # float32, like every run here
REUSE = _reuse(recompute="cacheblend", recompute_ratio=1.0)
PROPOSER = sam_engine(6)
# 256-token steps split the ~1.1K-token prompts: chunked prefill joins the pairs that use it
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def prompts(default_model) -> list[list[int]]:
    from transformers import AutoTokenizer

    from vllm_accel.quality.data import essays_dir

    tok = AutoTokenizer.from_pretrained(default_model)
    sep = tok.convert_tokens_to_ids("<file_sep>")
    docs = [tok.encode(p.read_text(), add_special_tokens=False)[:260]
            for p in sorted(Path(essays_dir()).glob("*.txt"))[:4]]
    head = tok.encode("You answer questions about documents.", add_special_tokens=False)
    question = tok.encode("Question: what is the first document about? Answer:",
                          add_special_tokens=False)
    return [head + [t for i in order for t in [sep] + docs[i]] + [sep] + question
            for order in ([0, 1, 2, 3], [2, 0, 3, 1])]


@pytest.fixture(scope="module")
def run(prompts, default_model, tmp_path_factory):
    """run(label, *features) -> (token ids per prompt, engine result, log text); cached. KIVI
    engines also record each prompt position's log-probability (``prompt_predictions``)."""
    log_dir = tmp_path_factory.mktemp("composition")
    cache: dict[str, tuple[list[list[int]], dict[str, Any], str]] = {}

    def go(label: str, *features: dict[str, Any]):
        if label not in cache:
            engine: dict[str, Any] = {"dtype": "float32"}
            for feature in features:
                engine.update(feature)
            tasks = [{"kind": "generate", "name": "out", "prompts": prompts,
                      "max_tokens": MAX_TOKENS, "sequential": True, "ignore_eos": True}]
            if "kv_cache_dtype" in engine:  # KIVI engines also score every prompt position
                tasks.append({"kind": "prompt_predictions", "name": "prompt", "prompts": prompts})
            result = run_side(label, engine_settings(default_model, 2048, 0.2, engine), tasks,
                              timeout_s=900, log_dir=log_dir)
            tokens = [o["token_ids"] for o in result["tasks"]["out"]]
            cache[label] = tokens, result, (log_dir / f"{label}.log").read_text()
        return cache[label]

    return go


def _reused_requests(log: str) -> float:
    return _counter(log, "scheduler", "reused_requests")


def _accepted(result: dict[str, Any]) -> int:
    return result["spec_decoding"]["total"]["num_accepted_tokens"]


def test_sparse_prefill_with_chunk_reuse(run):
    sparse, _, sparse_log = run("sparse", SPARSE)
    dense, _, _ = run("plain")
    both, _, log = run("sparse+reuse", SPARSE, REUSE)
    assert "run block-sparse attention in" in sparse_log and sparse != dense  # it ran
    assert _reused_requests(log) == 1
    assert both[0] == sparse[0]  # first sight: sparse prefill, chunks saved
    assert both[1] == dense[1]  # reused: claimed tokens recomputed densely, question after


def test_kivi_with_proposer(run):
    """Drafts are verified on the quantized cache: 1 + k query rows per step go through the
    torch path of KIVI attention instead of the one-row native decode kernel, over the same
    quantized bytes, so in float32 the tokens must be those of KIVI without the proposer.
    Both engines split the prompts the same way (chunked prefill, 256-token steps)."""
    kivi, _, _ = run("kivi+chunked", KIVI, CHUNKED)
    both, result, log = run("kivi+proposer+chunked", KIVI, PROPOSER, CHUNKED)
    assert "Using ACCEL_KIVI_4BIT backend" in log
    assert both == kivi
    assert _accepted(result) > 0


def _prompt_logprob_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference, over the prompts' positions, between two engines' log-probability
    of the prompt token (nats)."""
    return max(abs(x - y)
               for pa, pb in zip(a["tasks"]["prompt"], b["tasks"]["prompt"])
               for x, y in zip(pa["logprobs"], pb["logprobs"]) if x is not None)


def test_kivi_chunked_prefill_reads_earlier_steps_unquantized(run):
    """With the exact prompt buffer (``prompt_exact_tokens``, on by default) a prompt split
    into 256-token steps computes what one-step prefill computes: every position of the two
    ~1.1K-token prompts gets the log-probability KIVI gives it prefilling the prompt in one
    step, to float32 rounding. Without the buffer the later steps read the earlier ones
    quantized, and positions after the first step move (1.9 nats at most on SmolLM2, against
    5e-5 with the buffer). Generated tokens are not compared: the second prompt's continuation
    has a 1e-4-nat tie that the CPU's vector ISA alone flips (Intel vs AMD hosts)."""
    _, one_step, _ = run("kivi", KIVI)
    _, chunked, log = run("kivi+chunked", KIVI, CHUNKED)
    _, off, _ = run("kivi+chunked+no-buffer", KIVI, CHUNKED, {"additional_config": {
        "vllm_accel": {"kv_quant": {"prompt_exact_tokens": 0}}}})
    assert "KIVI exact prompt buffer: up to 8192 prompt tokens" in log
    exact, quantized = _prompt_logprob_gap(chunked, one_step), _prompt_logprob_gap(off, one_step)
    assert exact < 1e-3, exact
    assert quantized > 0.1, quantized


def test_chunk_reuse_with_proposer(run):
    """With chunked prefill too (the plain run prefills each prompt in one step)."""
    dense, _, _ = run("plain")
    both, result, log = run("reuse+proposer+chunked", REUSE, PROPOSER, CHUNKED)
    assert _reused_requests(log) == 1
    assert both == dense
    assert _accepted(result) > 0


def test_sparse_prefill_chunk_reuse_and_proposer(run):
    """Also the sparse prefill + proposer pair: the first prompt (nothing to reuse yet) must
    be sparse prefill's own tokens."""
    sparse, _, _ = run("sparse", SPARSE)
    pair, _, _ = run("sparse+reuse", SPARSE, REUSE)
    full, result, log = run("sparse+reuse+proposer", SPARSE, REUSE, PROPOSER)
    assert _reused_requests(log) == 1
    assert full == pair
    assert full[0] == sparse[0]
    assert _accepted(result) > 0


def test_refused_pair_fails_at_start_up(default_model, tmp_path):
    engine = engine_settings(default_model, 2048, 0.2, {**SPARSE, **KIVI})
    with pytest.raises(BenchError):
        run_side("refused", engine, [], timeout_s=600, log_dir=tmp_path)
    log = (tmp_path / "refused.log").read_text()
    assert ("--attention-backend ACCEL_SPARSE_PREFILL (sparse prefill) cannot be combined with "
            "--kv-cache-dtype kivi_4bit|kivi_2bit (KIVI KV cache)") in log
