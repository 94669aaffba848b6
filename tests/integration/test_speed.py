"""ACCEL_SPEED inside real vLLM CPU engines, checked token for token against the PyTorch oracle.

Tiny random Llama/Qwen2 models in float32 (any wrong visibility, a skipped token that should
have run, or a missing anchor changes the greedy tokens of a random model quickly), and the
real default model. Prompts run one at a time (the oracle is batch-free), plus one batched run
with chunked prefill that must give the same tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from vllm_accel.bench.harness import BenchError, engine_settings, run_side

MAX_TOKENS = 12


@pytest.fixture
def run_greedy(tmp_path):
    """run_greedy(label, model_dir, prompts, **engine) -> (token ids per prompt, log text):
    one engine, prompts one at a time, exactly MAX_TOKENS tokens each."""

    def run(label: str, model_dir: str, prompts: list[list[int]], **engine):
        settings = engine_settings(model_dir, 2048, 0.2, engine)
        task = {"kind": "generate", "name": "out", "prompts": prompts,
                "max_tokens": MAX_TOKENS, "sequential": True, "ignore_eos": True}
        result = run_side(label, settings, [task], timeout_s=900, log_dir=tmp_path)
        return ([o["token_ids"] for o in result["tasks"]["out"]],
                Path(tmp_path, f"{label}.log").read_text())

    return run


def _speed(**knobs) -> dict:
    return {"attention_backend": "ACCEL_SPEED", "dtype": "float32",
            "additional_config": {"vllm_accel": {"speed": knobs}}}


def _oracle(model_dir: str, prompts: list[list[int]], max_tokens: int, cut, anchor: int):
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_accel.speed.reference import speed_greedy

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return [speed_greedy(model, p, max_tokens, cut, anchor, eos_token_id=None) for p in prompts]


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> str:
    from vllm_accel.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2"))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_matches_oracle_token_for_token(run_greedy, tiny_llama, tiny_qwen2, arch):
    model_dir = tiny_llama if arch == "llama" else tiny_qwen2
    prompts = _prompts(0, (1, 3, 37, 300))
    outs, log = run_greedy("speed", model_dir, prompts, **_speed(cut=2, anchor_tokens=1))
    assert "ACCEL_SPEED: Speed" in log and "with 2 of 4 layers for prompt tokens" in log
    assert outs == _oracle(model_dir, prompts, MAX_TOKENS, 2, 1)


def test_chunked_prefill_batched_and_anchor_3_match_oracle(tiny_llama, tmp_path):
    prompts = _prompts(1, (700, 90, 5, 450))
    engine = engine_settings(tiny_llama, 2048, 0.2, {
        **_speed(cut=0.75, anchor_tokens=3), "enable_chunked_prefill": True,
        "max_num_batched_tokens": 128, "max_num_seqs": 4})
    task = {"kind": "generate", "name": "out", "prompts": prompts, "max_tokens": MAX_TOKENS,
            "ignore_eos": True}  # all at once: batched, chunked, mixed prefill/decode
    result = run_side("chunked", engine, [task], timeout_s=900, log_dir=tmp_path)
    expected = _oracle(tiny_llama, prompts, MAX_TOKENS, 0.75, 3)
    assert [o["token_ids"] for o in result["tasks"]["out"]] == expected


def test_prefix_caching_and_preemption_match_oracle(tiny_llama, tmp_path):
    """Prefix caching on (repeated and shared-prefix prompts) and a KV cache so small that
    decoding preempts requests (their recompute re-runs the prompt through SPEED): the same
    tokens as the oracle, request by request."""
    shared = _prompts(3, (190,))[0]
    prompts = [shared, shared, shared[:150] + _prompts(4, (40,))[0], _prompts(5, (188,))[0]]
    # 32-token blocks; vLLM splits the 3 lower layers into 3 one-layer KV groups of the size
    # of the upper group: a 190-token prompt takes 3 x 6 lower blocks + the upper group's, and
    # its decode crosses into a 7th block in every group. With 44 blocks two prompts run at
    # once and their decodes do not fit (measured: 3 preemptions; 40 runs one at a time, 56
    # never preempts).
    engine = engine_settings(tiny_llama, 256, 0.2, {
        **_speed(cut=0.75), "enable_prefix_caching": True, "block_size": 32,
        "num_gpu_blocks_override": 44, "max_num_seqs": 4})
    task = {"kind": "generate", "name": "out", "prompts": prompts, "max_tokens": MAX_TOKENS,
            "ignore_eos": True}
    result = run_side("prefix_preempt", engine, [task], timeout_s=900, log_dir=tmp_path)
    assert result["events"]["out"]["preemptions"] > 0
    expected = _oracle(tiny_llama, prompts, MAX_TOKENS, 0.75, 1)
    assert [o["token_ids"] for o in result["tasks"]["out"]] == expected


def test_cut_1_is_plain_vllm_and_a_real_cut_changes_output(run_greedy, tiny_llama):
    prompts = _prompts(2, (200,))
    base, _ = run_greedy("baseline", tiny_llama, prompts, dtype="float32")
    full, _ = run_greedy("cut_1", tiny_llama, prompts, **_speed(cut=1.0))
    assert full == base
    cut, _ = run_greedy("cut_1_layer", tiny_llama, prompts, **_speed(cut=1))
    assert cut != base


def test_bad_cut_fails_at_start_up_naming_the_knob(run_greedy, tiny_llama, tmp_path):
    with pytest.raises(BenchError):
        run_greedy("bad", tiny_llama, [[5, 6, 7]], **_speed(cut=1.5))
    log = Path(tmp_path, "bad.log").read_text()
    assert "vllm_accel.speed.cut" in log


def test_adapted_model_serves_at_its_own_cut(run_greedy, tiny_llama, tmp_path):
    """`vllm-accel speed-adapt` output: plain weights vLLM loads, and the cut and anchor written
    to its config are what ACCEL_SPEED uses with no flag; a flag still overrides (with a
    warning). Tokens equal the oracle on the adapted weights."""
    from vllm_accel.speed.adapt.data import DataPlan
    from vllm_accel.speed.adapt.run import AdaptJob, adapt
    from vllm_accel.speed.adapt.train_plan import TrainPlan

    out = adapt(AdaptJob(tiny_llama, str(tmp_path / "adapted"), cut=0.5, anchor_tokens=2,
                         data=DataPlan(examples=6, min_prompt_tokens=40, max_prompt_tokens=64),
                         train=TrainPlan(epochs=1, batch=3, lr=1e-2, lora_rank=4)),
                log=lambda *_: None)["out"]
    prompts = _prompts(4, (50, 260))
    outs, log = run_greedy("adapted", out, prompts, attention_backend="ACCEL_SPEED",
                           dtype="float32")
    assert "cut=0.5 from the adapted model's config" in log
    assert "with 2 of 4 layers for prompt tokens" in log
    assert outs == _oracle(out, prompts, MAX_TOKENS, 0.5, 2)
    assert outs != _oracle(tiny_llama, prompts, MAX_TOKENS, 0.5, 2)  # the weights changed
    _, log = run_greedy("adapted_flag", out, prompts[:1], **_speed(cut=3))
    assert "overrides the model's adapted cut=0.5" in log


@pytest.mark.real_model
def test_real_model_matches_oracle(run_greedy, default_model):
    """SmolLM2-135M (Llama architecture, 30 layers, cut 0.75 -> 23 lower layers)."""
    from vllm_accel.quality.prompts import chat_ids, load_tokenizer

    tok = load_tokenizer(default_model)
    prompts = [chat_ids(tok, q) for q in ("What is the capital of France?",
                                          "Write a Python function that adds two numbers.")]
    outs, log = run_greedy("speed_real", default_model, prompts, **_speed())
    assert "with 23 of 30 layers for prompt tokens" in log
    assert outs == _oracle(default_model, prompts, MAX_TOKENS, 0.75, 1)
