"""ACCEL_SPARSE_PREFILL inside real vLLM CPU engines (tiny random model, tiny threshold).

* every block selected (density 1.0): greedy output token-identical to vLLM's default backend,
  and so is ``method=dense`` (the benchmark's baseline);
* a real budget with chunked prefill, prefix caching and long prefills batched with decodes;
* the engine log and the per-step statistics show that the sparse path ran;
* a bad knob stops the engine at start-up with a message naming it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from vllm_accel.bench.harness import BenchError, engine_settings, run_side

# small blocks so that the tiny prompts have many of them
TINY_KNOBS = {"threshold": 128, "query_block_size": 64, "key_block_size": 32, "stride": 16}


def _ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def _sparse(stats: Path | None = None, **knobs) -> dict:
    section = {**TINY_KNOBS, **knobs}
    if stats is not None:
        section["stats_path"] = str(stats)
    return {"attention_backend": "ACCEL_SPARSE_PREFILL",
            "additional_config": {"vllm_accel": {"sparse_prefill": section}}}


def _stats(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_all_blocks_and_method_dense_match_default_backend(generate, tiny_llama, tmp_path):
    rng = random.Random(0)
    prompts = [_ids(n, rng) for n in (90, 300, 1500)]  # the first stays dense (< 128)
    base, _ = generate("baseline", tiny_llama, prompts, 12, dtype="float32")
    stats = tmp_path / "all_blocks.jsonl"
    sparse, log = generate("all_blocks", tiny_llama, prompts, 12, dtype="float32",
                           **_sparse(stats, tau=None, density=1.0))
    assert "Using ACCEL_SPARSE_PREFILL backend on CPU" in log
    assert "first sparse prefill of this process" in log
    records = [r for r in _stats(stats) if r["sparse_tokens"]]
    assert records and all(r["density"] == pytest.approx(1.0) for r in records)
    assert {r["sparse_max_seq_len"] for r in records} >= {300, 1500}
    assert [o["token_ids"] for o in sparse] == [o["token_ids"] for o in base]
    dense, log = generate("method_dense", tiny_llama, prompts, 12, dtype="float32",
                          **_sparse(method="dense"))
    assert "method=dense" in log and "first sparse prefill" not in log
    assert [o["token_ids"] for o in dense] == [o["token_ids"] for o in base]


def test_real_budget_with_chunked_prefill_prefix_cache_and_decodes(tiny_llama, tmp_path):
    rng = random.Random(1)
    shared = _ids(900, rng)
    stats = tmp_path / "budget.jsonl"
    engine = engine_settings(tiny_llama, 2048, 0.2, {
        **_sparse(stats, tau=0.6, density=0.5, dense_layers=[0]),
        "enable_prefix_caching": True, "enable_chunked_prefill": True,
        "max_num_batched_tokens": 256, "max_num_seqs": 8,
    })
    tasks = [
        # fills the prefix cache with the shared 900 tokens
        {"kind": "generate", "name": "warm", "prompts": [shared + _ids(20, rng)],
         "max_tokens": 2, "sequential": True},
        # one prefix-cache hit, one long fresh prompt, two short ones that decode meanwhile
        {"kind": "generate", "name": "batch", "max_tokens": 24, "prompts": [
            shared + _ids(300, rng), _ids(40, rng), _ids(1200, rng), _ids(60, rng)]},
    ]
    result = run_side("budget", engine, tasks, timeout_s=900, log_dir=tmp_path)
    log = (tmp_path / "budget.log").read_text()
    assert "first sparse prefill of this process" in log
    outs = result["tasks"]["batch"]
    assert all(len(o["token_ids"]) >= 1 for o in outs)
    assert outs[0]["num_cached_tokens"] >= 512  # the shared prefix came from the cache
    records = [r for r in _stats(stats) if r["sparse_tokens"]]
    assert all(r["sparse_tokens"] <= 256 for r in records)  # chunked prefill
    assert any(r["sparse_context_tokens"] > 0 for r in records)  # chunks after context/hits
    assert any(r["decode_tokens"] > 0 for r in records)  # batched with decodes
    assert any(r["dense_prefill_tokens"] > 0 or r["decode_tokens"] > 0 for r in records)
    assert min(r["density"] for r in records) < 0.9  # the budget really dropped blocks
    assert all("0" not in r["layer_density"] for r in records)  # layer 0 kept dense
    assert all(r["sparse_layers"] == 3 for r in records)


def test_bad_knob_fails_at_start_up_naming_it(tiny_llama, tmp_path):
    engine = engine_settings(tiny_llama, 2048, 0.2, _sparse(tau=1.5))
    task = {"kind": "generate", "name": "out", "prompts": [[5, 6, 7]], "max_tokens": 2}
    with pytest.raises(BenchError):
        run_side("bad_knob", engine, [task], timeout_s=600, log_dir=tmp_path)
    log = (tmp_path / "bad_knob.log").read_text()
    assert "vllm_accel.sparse_prefill.tau=1.5: must be in (0, 1]" in log
