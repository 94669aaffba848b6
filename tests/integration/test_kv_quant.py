"""--kv-cache-dtype kivi_4bit inside real vLLM CPU engines: selected automatically, counts the
real page bytes, answers correctly on the real model, and refuses bad settings at start-up.

Capacity: the residual keys of each running request's unfinished 64-token key group live in the
residual pool (``residual="tail"``, the default), so kivi_4bit pages store 72 B per token and KV
head at head size 64 against bf16's 256 B: 3.56x the tokens. ``residual="page"`` keeps them in
every page instead (136 B, 1.88x) and must give the same tokens.
"""

from __future__ import annotations

import re

import pytest

from vllm_accel.bench.harness import BenchError, engine_settings, run_side
from vllm_accel.quality.prompts import chat_ids, load_tokenizer

KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
TAIL_RESIDUAL_RATIO_4BIT = 256 / 72
PAGE_RESIDUAL = {"additional_config": {"vllm_accel": {"kv_quant": {"residual": "page"}}}}


def kv_cache_tokens(log: str) -> int:
    (tokens,) = {int(m.replace(",", "")) for m in KV_TOKENS.findall(log)}
    return tokens


def test_tiny_model_kivi_4bit_selects_backend_and_counts_page_bytes(generate, tiny_llama):
    tok = load_tokenizer(tiny_llama)
    prompts = [tok(q)["input_ids"] for q in ("What is the capital of France?", "Hello there")]
    base, base_log = generate("bf16", tiny_llama, prompts, 16)
    kivi, log = generate("kivi_4bit", tiny_llama, prompts, 16, ignore_eos=True,
                         kv_cache_dtype="kivi_4bit")
    assert "--kv-cache-dtype kivi_4bit: selecting the ACCEL_KIVI_4BIT attention backend" in log
    assert "Using ACCEL_KIVI_4BIT backend on CPU" in log
    assert "72 B/token/head" in log  # the page format the impl runs with
    assert "KIVI residual pool: " in log
    assert all(len(o["token_ids"]) == 16 for o in kivi)
    ratio = kv_cache_tokens(log) / kv_cache_tokens(base_log)
    assert ratio == pytest.approx(TAIL_RESIDUAL_RATIO_4BIT, rel=0.01)


def test_format_knobs_set_the_page_vllm_budgets(generate, tiny_llama):
    """key_group 32 (with --block-size 32), value_group 16 and 4 sink slots per page: the page
    the impl logs and the tokens vLLM admits follow the knobs' bytes, and the native kernels
    run it."""
    from vllm_accel.kernels.kivi_format import KiviLayout

    knobs = {"key_group": 32, "value_group": 16, "sink_tokens": 4}
    head_size = 64  # tiny_llama
    layout = KiviLayout.preset("kivi_4bit", head_size, 32, **knobs)
    prompts = [[(5 * j) % 400 + 1 for j in range(70)]]
    base, base_log = generate("bf16_b32", tiny_llama, prompts, 8, block_size=32)
    out, log = generate("knobs", tiny_llama, prompts, 8, kv_cache_dtype="kivi_4bit",
                        block_size=32, additional_config={"vllm_accel": {"kv_quant": knobs}})
    assert f"{layout.bytes_per_token_head} B/token/head" in log
    assert "cache write and attention kernel native" in log
    assert len(out[0]["token_ids"]) == 8
    ratio = kv_cache_tokens(log) / kv_cache_tokens(base_log)
    assert ratio == pytest.approx(2 * head_size * 2 / layout.bytes_per_token_head, rel=0.01)


def test_residual_pool_gives_the_tokens_of_in_page_residuals(generate, tiny_llama):
    """Six prompts of different lengths, batched, at most three running: the last three take
    the pool slots of the first three once those finish. The pool holds the same bf16 keys the
    page residual area would, so greedy tokens must be identical. (Rows that move between
    steps: tests/unit/kv_quant/test_impl.py.)"""
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(length)]
               for i, length in enumerate((5, 70, 130, 40, 200, 64))]
    engine = dict(kv_cache_dtype="kivi_4bit", max_num_seqs=3)
    tail, tail_log = generate("tail", tiny_llama, prompts, 24, **engine, sequential=False)
    page, page_log = generate("page", tiny_llama, prompts, 24, **engine, **PAGE_RESIDUAL,
                              sequential=False)
    assert "residual=tail" in tail_log and "residual=page" in page_log
    assert [o["token_ids"] for o in tail] == [o["token_ids"] for o in page]


@pytest.mark.real_model
def test_default_model_kivi_4bit_answers_correctly(generate, default_model):
    tok = load_tokenizer(default_model)
    questions = ["What is the capital of France?",
                 "Write a Python function that returns the square of a number."]
    prompts = [chat_ids(tok, q) for q in questions]
    # float32: vLLM 0.32's own bf16 CPU path answers wrongly on some CPUs (Intel AMX:
    # "L'Étoile, ..." with or without vllm_accel; docs/compatibility.md)
    out, log = generate("kivi_4bit", default_model, prompts, 40, kv_cache_dtype="kivi_4bit",
                        dtype="float32")
    assert "Using ACCEL_KIVI_4BIT backend on CPU" in log
    assert "dtype=float32" in log  # the residual keys are stored in the model dtype
    assert "Paris" in out[0]["text"]
    assert "def " in out[1]["text"]


def test_residual_pool_survives_preemption_and_prefix_caching(tiny_llama, tmp_path):
    """A KV cache so small that decoding preempts requests (a preempted request keeps its pool
    slot; its recompute rewrites the unfinished group) and prompts that share full blocks
    (prefix-cache hits start past complete groups): same tokens as the in-page residual with
    the same number of blocks, hence the same schedule. Four usable 128-token blocks, three
    requests of up to 320 tokens at once: decoding preempts (both counters asserted)."""
    def ids(seed, n):
        return [(seed * 31 + 7 * j) % 500 + 1 for j in range(n)]

    shared = ids(1, 260)
    prompts = [shared, shared, shared[:140] + ids(2, 60), ids(3, 200), ids(4, 70), ids(5, 40)]
    outs = {}
    for residual in ("tail", "page"):
        engine = engine_settings(tiny_llama, 512, 0.2, {
            "kv_cache_dtype": "kivi_4bit", "enable_prefix_caching": True,
            "num_gpu_blocks_override": 5, "max_num_seqs": 3,
            "additional_config": {"vllm_accel": {"kv_quant": {"residual": residual}}}})
        task = {"kind": "generate", "name": "out", "prompts": prompts, "max_tokens": 60,
                "ignore_eos": True}
        result = run_side(residual, engine, [task], timeout_s=900, log_dir=tmp_path,
                          deterministic_batches=True)
        events = result["events"]["out"]
        assert events["preemptions"] > 0 and events["prefix_cache_hit_tokens"] > 0, events
        outs[residual] = [o["token_ids"] for o in result["tasks"]["out"]]
    assert outs["tail"] == outs["page"]


def test_unknown_kivi_name_keeps_vllms_error(tiny_llama):
    import pydantic
    from vllm.engine.arg_utils import EngineArgs

    from vllm_accel import plugin

    plugin.register()
    args = EngineArgs(model=tiny_llama, kv_cache_dtype="kivi_3bit", max_model_len=512)
    with pytest.raises(pydantic.ValidationError, match="cache_dtype"):
        args.create_engine_config()


def test_block_size_that_splits_key_groups_fails_at_start_up(generate, tiny_llama, tmp_path):
    with pytest.raises(BenchError):
        generate("bad_block", tiny_llama, [[1, 2, 3]], 2, kv_cache_dtype="kivi_4bit",
                 block_size=32)
    log = (tmp_path / "bad_block.log").read_text()
    assert "--block-size 32 is not supported with --kv-cache-dtype kivi_4bit" in log
    assert "multiples of 64" in log
