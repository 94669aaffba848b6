"""``vllm-accel speed-adapt``: one command from a stock model to a SPEED-adapted one.

Stages, each resumable from ``--work-dir`` (default: ``OUT`` + ``.work``, next to the output):

1. **checks** before anything heavy: architecture supported, cut in range and below the depth,
   output directory absent or empty, enough disk for the result;
2. **teacher pass**: the training prompts (:mod:`.data`), the dense model's answers to the
   retrieval ones, and per example the few tensors the student needs (:mod:`.student`), saved
   in shards;
3. **training** of low-rank adapters on the upper layers (:mod:`.train`), checkpointed;
4. **export**: adapters merged into the weights, ``config.json`` gets the cut and anchor
   (``vllm_accel_speed``, read by ``--attention-backend ACCEL_SPEED``), written to a temporary
   directory and renamed into place -- an interrupted run never leaves a model that loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_accel.speed.adapt.data import DataPlan
from vllm_accel.speed.adapt.train_plan import TrainPlan
from vllm_accel.speed.config import ADAPTED_CONFIG_KEY, SpeedConfig

SHARD = 16  # examples per teacher-feature shard


class AdaptError(ValueError):
    """Bad input, reported before any training starts."""


@dataclass
class AdaptJob:
    model: str
    out: str
    cut: float | int = 0.75
    anchor_tokens: int = 1
    data: DataPlan = field(default_factory=DataPlan)
    train: TrainPlan = field(default_factory=TrainPlan)
    work_dir: str | None = None
    device: str = "auto"
    keep_work: bool = False

    @property
    def work(self) -> Path:
        return Path(self.work_dir or self.out.rstrip("/") + ".work")


def _model_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise AdaptError(f"--model {model_dir}: no config.json (give a Hugging Face model "
                         f"directory or a catalogue name)")
    return json.loads(path.read_text())


def _weights_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) or sum(
        p.stat().st_size for p in model_dir.glob("*.bin"))


def check(job: AdaptJob) -> int:
    """Validate ``job``; returns the number of lower layers. Raises :class:`AdaptError`."""
    from vllm_accel.speed.reference import check_config

    model_dir = Path(job.model)
    config = _model_config(model_dir)
    try:
        check_config(config.get("model_type"), config.get("layer_types"))
    except ValueError as exc:
        raise AdaptError(f"--model {model_dir}: {exc}") from None
    speed = SpeedConfig(cut=job.cut, anchor_tokens=job.anchor_tokens)
    problems = speed.validate()
    if problems:
        key, why = next(iter(problems.items()))
        raise AdaptError(f"--{key.replace('_', '-')} {getattr(speed, key)!r}: {why}")
    num_layers = int(config["num_hidden_layers"])
    try:
        num_lower = speed.num_lower_layers(num_layers)
    except ValueError as exc:
        raise AdaptError(f"--cut {job.cut!r}: {exc}") from None
    if num_lower >= num_layers:
        raise AdaptError(f"--cut {job.cut!r} keeps all {num_layers} layers for prompt tokens "
                         f"(dense): nothing to adapt; use a cut below 1.0")
    try:
        job.data.validate()
        job.train.validate()
    except ValueError as exc:
        raise AdaptError(str(exc)) from None
    out = Path(job.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AdaptError(f"--out {out}: exists and is not an empty directory; choose a new "
                         f"path or remove it")
    need = int(_weights_bytes(model_dir) * 1.1) + job.data.examples * 2_000_000
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if free < need:
        raise AdaptError(f"--out {out}: {free / 2**30:.1f} GiB free on that disk, "
                         f"{need / 2**30:.1f} GiB needed (the adapted weights plus the teacher "
                         f"features); free space or choose another --out")
    return num_lower


def _fingerprint(job: AdaptJob, model_config: dict) -> str:
    text = json.dumps({"model": str(Path(job.model).resolve()), "config": model_config,
                       "cut": job.cut, "anchor": job.anchor_tokens, "data": asdict(job.data),
                       "train": asdict(job.train)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _prepare_work(job: AdaptJob) -> Path:
    """The work directory of this exact job (a different job's leftovers are refused)."""
    work = job.work
    stamp = work / "job.json"
    fingerprint = _fingerprint(job, _model_config(Path(job.model)))
    if work.exists() and any(work.iterdir()):
        if not stamp.exists() or json.loads(stamp.read_text()).get("fingerprint") != fingerprint:
            raise AdaptError(f"--work-dir {work}: holds another run's state (different model, "
                             f"cut or settings); remove it or give another --work-dir")
        return work
    work.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"fingerprint": fingerprint, "job": asdict(job)}, indent=1,
                                default=str))
    return work


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _teacher_pass(model, tokenizer, job: AdaptJob, num_lower: int, work: Path, progress):
    """All examples' :class:`Features`, computing only the shards not yet on disk."""
    import torch

    from vllm_accel.speed.adapt.data import build_examples
    from vllm_accel.speed.adapt.student import teacher_features
    from vllm_accel.speed.reference import speed_greedy

    examples = build_examples(tokenizer, job.data)
    features = []
    bar = progress(total=len(examples), desc="speed-adapt teacher", unit="ex") if progress \
        else None
    for start in range(0, len(examples), SHARD):
        path = work / f"features-{start // SHARD:04d}.pt"
        if path.exists():
            shard = torch.load(path, weights_only=False)
        else:
            shard = []
            for ex in examples[start : start + SHARD]:
                cont = ex.continuation_ids
                if cont is None:  # the dense model's own answer (it stops at EOS)
                    cont = speed_greedy(model, ex.prompt_ids, 16, 1.0, job.anchor_tokens,
                                        eos_token_id=tokenizer.eos_token_id)
                ids = list(ex.prompt_ids) + list(cont)
                shard.append(teacher_features(model, ids, len(ex.prompt_ids), num_lower,
                                              job.anchor_tokens, ex.kind))
            tmp = path.with_name(path.name + ".tmp")
            torch.save(shard, tmp)
            os.replace(tmp, path)
        features.extend(shard)
        if bar:
            bar.update(len(shard))
    if bar:
        bar.close()
    return features


def _export(model, tokenizer, job: AdaptJob, info: dict[str, Any], dtype) -> Path:
    """Write the merged model to ``job.out`` atomically (temporary directory, then rename)."""
    out = Path(job.out)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    setattr(model.config, ADAPTED_CONFIG_KEY, info)
    try:
        model.to(dtype).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            out.rmdir()  # checked empty before training
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def adapt(job: AdaptJob, log=print, progress=None) -> dict[str, Any]:
    """Run ``job`` end to end (resuming from its work directory); returns the report."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_accel.quality.prompts import load_tokenizer
    from vllm_accel.speed.adapt import lora
    from vllm_accel.speed.adapt.train import mean_loss, train

    num_lower = check(job)
    work = _prepare_work(job)
    started = time.perf_counter()
    device = _device(job.device)
    torch.manual_seed(job.train.seed)
    tokenizer = load_tokenizer(job.model)
    model = AutoModelForCausalLM.from_pretrained(job.model, dtype=torch.float32).to(device)
    source = _model_config(Path(job.model))
    saved_dtype = getattr(torch, source.get("torch_dtype") or source.get("dtype") or "float32")
    model.eval()
    num_layers = len(model.model.layers)
    log(f"speed-adapt: {job.model} ({num_layers} layers), cut {job.cut} -> {num_lower} lower "
        f"layers, anchor {job.anchor_tokens}; adapters on layers {num_lower}..{num_layers - 1}, "
        f"device {device}, work dir {work}")
    features = _teacher_pass(model, tokenizer, job, num_lower, work, progress)
    held = max(1, len(features) // 10)
    train_set, val_set = features[:-held], features[-held:]
    lora.attach(model, range(num_lower, num_layers), job.train.lora_rank,
                job.train.lora_alpha, seed=job.train.seed)
    val_before = mean_loss(model, val_set, num_lower, 0.0)
    losses = train(model, train_set, num_lower, job.train, work / "checkpoint.pt", progress)
    val_after = mean_loss(model, val_set, num_lower, 0.0)
    log(f"speed-adapt: held-out KL(dense || SPEED) {val_before:.4f} -> {val_after:.4f} "
        f"({len(val_set)} examples)")
    merged = lora.merge(model)
    info = {"cut": job.cut, "anchor_tokens": job.anchor_tokens, "num_lower_layers": num_lower,
            "adapted_from": str(Path(job.model).resolve()),
            "method": f"self-distillation (KL to the dense model at decode positions), LoRA "
                      f"rank {job.train.lora_rank} on {merged} projections of layers "
                      f"{num_lower}..{num_layers - 1}, merged",
            "examples": len(train_set), "steps": len(losses),
            "heldout_kl_before": round(val_before, 5), "heldout_kl_after": round(val_after, 5),
            "date": time.strftime("%Y-%m-%d")}
    out = _export(model, tokenizer, job, info, saved_dtype)
    if not job.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    report = {**info, "out": str(out), "losses": losses,
              "seconds": round(time.perf_counter() - started, 1)}
    log(f"speed-adapt: wrote {out} ({report['seconds']:.0f} s this run); serve it with "
        f"--attention-backend ACCEL_SPEED (cut {job.cut} is read from its config)")
    return report
