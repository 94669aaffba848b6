"""The training loop: AdamW on the adapters, gradient accumulation, cosine schedule, and a
checkpoint every few steps that a rerun of the same command resumes from."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import torch

from vllm_accel.speed.adapt import lora
from vllm_accel.speed.adapt.student import Features, distillation_loss
from vllm_accel.speed.adapt.train_plan import TrainPlan


def _order(n: int, epoch: int, seed: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1000 + epoch).shuffle(order)
    return order


def _lr_factor(step: int, total: int) -> float:
    warmup = max(1, total // 20)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def mean_loss(model, features: list[Features], num_lower: int, hidden_weight: float) -> float:
    with torch.no_grad():
        return sum(float(distillation_loss(model, f, num_lower, hidden_weight))
                   for f in features) / max(1, len(features))


def _save(path: Path, state: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train(model, features: list[Features], num_lower: int, plan: TrainPlan,
          checkpoint: Path, progress=None) -> list[float]:
    """Train the adapters already attached to ``model``; returns the per-step mean losses
    (including those of steps done before a resume)."""
    plan.validate()
    params = [p for m in lora.adapters(model).values() for p in (m.lora_a, m.lora_b)]
    optimizer = torch.optim.AdamW(params, lr=plan.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(features) / plan.batch)
    total = steps_per_epoch * plan.epochs
    step, losses = 0, []
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        lora.load_adapter_state(model, state["adapters"])
        optimizer.load_state_dict(state["optimizer"])
        step, losses = state["step"], state["losses"]
    bar = progress(total=total, initial=step, desc="speed-adapt train", unit="step") \
        if progress else None
    model.train()
    while step < total:
        epoch, index = divmod(step, steps_per_epoch)
        batch = _order(len(features), epoch, plan.seed)[index * plan.batch:
                                                          (index + 1) * plan.batch]
        for group in optimizer.param_groups:
            group["lr"] = plan.lr * _lr_factor(step, total)
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for i in batch:
            loss = distillation_loss(model, features[i], num_lower, plan.hidden_weight)
            (loss / len(batch)).backward()
            step_loss += float(loss.detach()) / len(batch)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        losses.append(step_loss)
        if bar:
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss:.4f}")
        if step % plan.checkpoint_every == 0 or step == total:
            _save(checkpoint, {"step": step, "losses": losses, "optimizer":
                               optimizer.state_dict(), "adapters": lora.adapter_state(model)})
    if bar:
        bar.close()
    model.eval()
    return losses
