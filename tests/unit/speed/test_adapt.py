"""``vllm-accel speed-adapt``: the student is the oracle, adapters merge exactly, the run resumes,
bad input fails before training, and the output carries its cut to the backend's knobs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from vllm_accel.speed.adapt import lora
from vllm_accel.speed.adapt.data import DataPlan, build_examples, code_files
from vllm_accel.speed.adapt.run import AdaptError, AdaptJob, adapt, check
from vllm_accel.speed.adapt.student import distillation_loss, student_hidden, teacher_features
from vllm_accel.speed.adapt.train_plan import TrainPlan
from vllm_accel.speed.config import ADAPTED_CONFIG_KEY, resolve_speed_config
from vllm_accel.speed.policy import upper_positions


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> str:
    from vllm_accel.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2"))


def test_upper_positions():
    assert upper_positions(10, 6, 1) == [0, 5, 6, 7, 8, 9]
    assert upper_positions(6, 6, 2) == [0, 1, 5]
    with pytest.raises(ValueError):
        upper_positions(5, 6, 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_student_is_the_oracle(tiny_llama, tiny_qwen2, arch):
    """Before any training, the student's log-probs of the continuation are the oracle's
    (teacher-forced decode after a SPEED prefill): one visibility rule, shared."""
    from vllm_accel.speed.reference import speed_continuation_logprobs

    model = _model(tiny_llama if arch == "llama" else tiny_qwen2)
    prompt, cont = list(range(5, 45)), [7, 9, 11, 13, 15, 17]
    num_lower, anchor = 2, 2
    features = teacher_features(model, prompt + cont, len(prompt), num_lower, anchor)
    with torch.no_grad():
        hidden = student_hidden(model, features, num_lower)
        logp = torch.log_softmax(model.lm_head(hidden).float(), -1)
    mine = [float(logp[i, t]) for i, t in enumerate(cont)]
    oracle = speed_continuation_logprobs(model, prompt, cont, num_lower, anchor)
    assert mine == pytest.approx(oracle, abs=1e-4)
    # The teacher's own (dense) final hidden states are what the loss compares against.
    dense = model(torch.tensor([prompt + cont])).logits[0, len(prompt) - 1:-1]
    assert torch.allclose(model.lm_head(features.teacher_hidden), dense, atol=1e-4)
    with torch.no_grad():
        kl = float(distillation_loss(model, features, num_lower))
        assert kl > 0
        assert float(distillation_loss(model, features, num_lower, hidden_weight=1.0)) > kl


def test_adapters_start_neutral_and_merge_exactly(tiny_llama):
    model = _model(tiny_llama)
    ids = torch.tensor([list(range(3, 40))])
    before = model(ids).logits
    names = lora.attach(model, [2, 3], rank=4, alpha=8.0)
    assert len(names) == 14 and all(".layers.2." in n or ".layers.3." in n for n in names)
    assert torch.allclose(model(ids).logits, before, atol=1e-6)  # B = 0
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora" not in n)
    for module in lora.adapters(model).values():
        torch.nn.init.normal_(module.lora_b, std=0.02)
    adapted = model(ids).logits
    assert not torch.allclose(adapted, before, atol=1e-4)
    state = lora.adapter_state(model)
    assert lora.merge(model) == 14 and not lora.adapters(model)
    assert isinstance(model.model.layers[2].mlp.down_proj, torch.nn.Linear)
    assert torch.allclose(model(ids).logits, adapted, atol=1e-4)
    with pytest.raises(ValueError, match="do not match"):
        lora.load_adapter_state(model, state)


def test_training_data_is_deterministic_and_apart_from_evaluation(tiny_llama):
    from vllm_accel.quality.prompts import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    plan = DataPlan(examples=10, min_prompt_tokens=400, max_prompt_tokens=500)
    a, b = build_examples(tok, plan), build_examples(tok, plan)
    assert a == b and len(a) == 10
    assert {e.kind for e in a} == {"retrieval", "essay", "code"}
    for e in a:
        assert 400 - 8 <= len(e.prompt_ids) <= 500 + 8
        assert (e.continuation_ids is None) == (e.kind == "retrieval")
    text = " ".join(tok.decode(e.prompt_ids) for e in a if e.kind == "retrieval")
    assert "access code" in text or "code of the" in text or "opens with" in text
    assert "special magic number" not in text  # the evaluation's wording
    train, held = set(code_files("train")), set(code_files("eval"))
    assert train and held and not train & held


def _job(model_dir, tmp_path, **kw) -> AdaptJob:
    defaults = dict(model=model_dir, out=str(tmp_path / "adapted"), cut=0.5, anchor_tokens=1,
                    data=DataPlan(examples=12, min_prompt_tokens=40, max_prompt_tokens=80,
                                  continuation_tokens=8),
                    train=TrainPlan(epochs=3, batch=2, lr=3e-3, lora_rank=4,
                                    checkpoint_every=2))
    defaults.update(kw)
    return AdaptJob(**defaults)


def test_adapt_end_to_end_resume_and_config(tiny_qwen2, tmp_path, monkeypatch):
    from transformers import AutoConfig

    import vllm_accel.speed.adapt.student as student

    job = _job(tiny_qwen2, tmp_path, keep_work=True)
    report = adapt(job, log=lambda *_: None)
    out = Path(report["out"])
    assert report["heldout_kl_after"] < report["heldout_kl_before"]
    assert len(report["losses"]) == report["steps"] == 3 * math.ceil(report["examples"] / 2)
    config = json.loads((out / "config.json").read_text())
    assert config[ADAPTED_CONFIG_KEY]["cut"] == 0.5
    assert config[ADAPTED_CONFIG_KEY]["num_lower_layers"] == 2
    merged = _model(str(out))  # plain weights: no adapter modules, loads like any model
    assert not lora.adapters(merged)
    stock = _model(tiny_qwen2)
    assert torch.equal(merged.model.layers[0].mlp.up_proj.weight,
                       stock.model.layers[0].mlp.up_proj.weight)  # lower layers untouched
    assert not torch.equal(merged.model.layers[3].mlp.up_proj.weight,
                           stock.model.layers[3].mlp.up_proj.weight)

    # The backend's knobs: the model's cut unless a flag says otherwise.
    hf = AutoConfig.from_pretrained(out)
    cfg, sources = resolve_speed_config(None, hf, environ={})
    assert (cfg.cut, cfg.anchor_tokens, sources["cut"]) == (0.5, 1, "model")
    cfg, sources = resolve_speed_config({"vllm_accel": {"speed": {"cut": 3}}}, hf, environ={})
    assert (cfg.cut, sources["cut"], sources["anchor_tokens"]) == (3, "flag", "model")
    cfg, sources = resolve_speed_config(None, hf, environ={"VLLM_ACCEL_SPEED_CUT": "0.75"})
    assert (cfg.cut, sources["cut"]) == (0.75, "flag")
    assert resolve_speed_config(None, AutoConfig.from_pretrained(tiny_qwen2), {})[1]["cut"] \
        == "default"

    # Resume: the same job again reuses the teacher shards and the final checkpoint.
    shutil.rmtree(out)
    monkeypatch.setattr(student, "teacher_features", _raise)
    again = adapt(job, log=lambda *_: None)
    assert again["losses"] == report["losses"]
    assert torch.equal(_model(again["out"]).model.layers[3].mlp.up_proj.weight,
                       merged.model.layers[3].mlp.up_proj.weight)


def _raise(*args, **kwargs):
    raise AssertionError("teacher pass should have been resumed from disk")


def test_interrupted_export_leaves_no_model(tiny_qwen2, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    def crash(self, path, **kwargs):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", crash)
    job = _job(tiny_qwen2, tmp_path, data=DataPlan(examples=4, min_prompt_tokens=40,
                                                    max_prompt_tokens=48),
               train=TrainPlan(epochs=1, batch=2))
    with pytest.raises(KeyboardInterrupt):
        adapt(job, log=lambda *_: None)
    assert not Path(job.out).exists()
    assert not list(Path(job.out).parent.glob(".adapted.partial-*"))
    assert Path(job.work / "checkpoint.pt").exists()  # a rerun resumes from here


def test_bad_input_fails_before_training(tiny_llama, tmp_path):
    ok = _job(tiny_llama, tmp_path)
    assert check(ok) == 2
    for kw, message in [
        ({"cut": 1.0}, "nothing to adapt"),
        ({"cut": 1.5}, "--cut 1.5"),
        ({"cut": 9}, "out of range"),
        ({"anchor_tokens": 0}, "--anchor-tokens"),
        ({"model": str(tmp_path)}, "no config.json"),
        ({"train": TrainPlan(epochs=0)}, "--epochs"),
        ({"data": DataPlan(examples=1)}, "--examples"),
    ]:
        with pytest.raises(AdaptError, match=message):
            check(_job(tiny_llama, tmp_path, **kw))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(AdaptError, match="'gpt2' is not supported"):
        check(_job(str(gpt2), tmp_path))
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    with pytest.raises(AdaptError, match="not an empty directory"):
        check(_job(tiny_llama, tmp_path, out=str(full)))


def test_too_little_disk_fails_before_training(tiny_llama, tmp_path, monkeypatch):
    import collections

    import vllm_accel.speed.adapt.run as run

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(run.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000))
    with pytest.raises(AdaptError, match="GiB free on that disk"):
        check(_job(tiny_llama, tmp_path))


def test_work_dir_of_another_job_is_refused(tiny_qwen2, tmp_path):
    from vllm_accel.speed.adapt.run import _prepare_work

    _prepare_work(_job(tiny_qwen2, tmp_path))
    with pytest.raises(AdaptError, match="another run"):
        _prepare_work(_job(tiny_qwen2, tmp_path, cut=0.75))


def test_cli_reports_bad_input(tmp_path, capsys, tiny_llama):
    from vllm_accel.cli import main

    assert main(["speed-adapt", "--model", tiny_llama, "--out", str(tmp_path / "o"),
                 "--cut", "1.0"]) == 2
    assert "nothing to adapt" in capsys.readouterr().err
