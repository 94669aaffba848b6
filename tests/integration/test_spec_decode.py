"""SAMProposer inside real vLLM CPU engines: greedy output unchanged, drafts really accepted.

Engines run in float32: on CPUs without bf16 instructions vLLM's bf16 path is several times
slower, and the comparison (1 token per step vs verified drafts) is about the proposer, not
about bf16 rounding of different batch shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_accel.bench.harness import engine_settings, run_side
from vllm_accel.quality.prompts import chat_ids, load_tokenizer

SAM = "vllm_accel.spec_decode.SAMProposer"


def sam_engine(k: int = 6, **knobs: Any) -> dict[str, Any]:
    engine: dict[str, Any] = {"speculative_config": {"method": "custom_class", "model": SAM,
                                                     "num_speculative_tokens": k}}
    if knobs:
        engine["additional_config"] = {"vllm_accel": {"spec_decode": knobs}}
    return engine


@pytest.fixture
def spec_generate(tmp_path):
    """Like the ``generate`` fixture (one engine per process, sequential greedy), and also
    returns the engine's speculative-decoding totals."""

    def run(label: str, model_dir: str, prompts: list[list[int]], max_tokens: int,
            **engine: Any) -> tuple[list[dict[str, Any]], dict[str, int], str]:
        settings = engine_settings(model_dir, 2048, 0.2, {"dtype": "float32", **engine})
        task = {"kind": "generate", "name": "out", "prompts": prompts, "max_tokens": max_tokens,
                "sequential": True}
        result = run_side(label, settings, [task], timeout_s=900, log_dir=tmp_path)
        log = Path(tmp_path, f"{label}.log").read_text()
        return result["tasks"]["out"], result["spec_decoding"]["total"], log

    return run


def test_tiny_model_with_datastore_is_lossless(spec_generate, tiny_llama, tmp_path):
    """min_match=1 drafts at almost every step; the random model rejects most drafts, so this
    exercises rejection and partial acceptance. The datastore is loaded in the worker and
    checked against the model's tokenizer."""
    from vllm_accel.spec_decode import datastore

    tok = load_tokenizer(tiny_llama)
    texts = ["The quick brown fox jumps over the lazy dog. " * 3,
             "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
             "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 " * 2]
    (tmp_path / "corpus.txt").write_text("\n".join(texts) * 2)
    store = datastore.build(tok, [tmp_path / "corpus.txt"], tmp_path / "tiny.sam")
    prompts = [tok(t)["input_ids"] for t in texts]
    base, _, _ = spec_generate("baseline", tiny_llama, prompts, 32)
    sam, stats, log = spec_generate("sam", tiny_llama, prompts, 32,
                                    **sam_engine(min_match=1, datastore=str(store.out)))
    assert "patched GPUModelRunner.propose_draft_token_ids (proposer_input_batch" in log
    assert "SAMProposer: datastore" in log and "SAMProposer failed" not in log
    assert stats["num_draft_tokens"] > 0
    assert [o["token_ids"] for o in sam] == [o["token_ids"] for o in base]


CODE = '''def moving_average(values, window):
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''

QUESTIONS = [
    f"Add a docstring to this function and repeat the whole function:\n\n```python\n{CODE}```",
    f"Rename `values` to `samples` in this code and output the full code:\n\n```python\n{CODE}```",
    "What is the capital of France?",
]


@pytest.mark.real_model
def test_default_model_greedy_identical_and_drafts_accepted(spec_generate, default_model):
    tok = load_tokenizer(default_model)
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    base, _, _ = spec_generate("baseline", default_model, prompts, 96)
    sam, stats, log = spec_generate("sam", default_model, prompts, 96, **sam_engine(k=8))
    assert "SAMProposer failed" not in log
    assert [o["token_ids"] for o in sam] == [o["token_ids"] for o in base]
    assert "def " in sam[0]["text"]
    # The code is re-emitted, so drafts copied from the prompt are accepted. A proposer keyed
    # to the wrong request, or drafting from the wrong position, gets almost nothing accepted.
    # (SmolLM2-135M rewrites loosely: 39 accepted of 142 drafted in 23 drafts when written.)
    assert stats["num_accepted_tokens"] >= 20, stats
    assert stats["num_accepted_tokens"] / stats["num_drafts"] >= 1.0, stats
