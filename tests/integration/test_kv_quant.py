"""--kv-cache-dtype kivi_4bit inside real vLLM CPU engines: selected automatically, counts the
real page bytes, answers correctly on the real model, and refuses bad settings at start-up.

Capacity: the residual keys of each sequence's unfinished 64-token key group live in the page
(``residual="page"``), so kivi_4bit stores 136 B per token and KV head at head size 64 and block
128 against bf16's 256 B: 1.88x the tokens (not the 3.5x of the external-tail variant).
"""

from __future__ import annotations

import re

import pytest

from vllm_accel.bench.harness import BenchError
from vllm_accel.quality.prompts import chat_ids, load_tokenizer

KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
PAGE_RESIDUAL_RATIO_4BIT = 256 / 136


def kv_cache_tokens(log: str) -> int:
    (tokens,) = {int(m.replace(",", "")) for m in KV_TOKENS.findall(log)}
    return tokens


def test_tiny_model_kivi_4bit_selects_backend_and_counts_page_bytes(generate, tiny_llama):
    tok = load_tokenizer(tiny_llama)
    prompts = [tok(q)["input_ids"] for q in ("What is the capital of France?", "Hello there")]
    base, base_log = generate("bf16", tiny_llama, prompts, 16)
    kivi, log = generate("kivi_4bit", tiny_llama, prompts, 16, kv_cache_dtype="kivi_4bit")
    assert "--kv-cache-dtype kivi_4bit: selecting the ACCEL_KIVI_4BIT attention backend" in log
    assert "Using ACCEL_KIVI_4BIT backend on CPU" in log
    assert "136 B/token/head" in log  # the page format the impl runs with
    assert all(len(o["token_ids"]) == 16 for o in kivi)
    ratio = kv_cache_tokens(log) / kv_cache_tokens(base_log)
    assert ratio == pytest.approx(PAGE_RESIDUAL_RATIO_4BIT, rel=0.01)


@pytest.mark.real_model
def test_default_model_kivi_4bit_answers_correctly(generate, default_model):
    tok = load_tokenizer(default_model)
    questions = ["What is the capital of France?",
                 "Write a Python function that returns the square of a number."]
    out, log = generate("kivi_4bit", default_model, [chat_ids(tok, q) for q in questions], 40,
                        kv_cache_dtype="kivi_4bit")
    assert "Using ACCEL_KIVI_4BIT backend on CPU" in log
    assert "Paris" in out[0]["text"]
    assert "def " in out[1]["text"]


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
