"""The training knobs of ``vllm-accel speed-adapt`` (no torch import: the CLI reads the
defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainPlan:
    epochs: int = 3
    lr: float = 3e-4
    lora_rank: int = 16
    lora_alpha: float = 32.0
    batch: int = 8  # examples per optimizer step
    hidden_weight: float = 0.0
    checkpoint_every: int = 5  # optimizer steps
    seed: int = 0

    def validate(self) -> None:
        for name in ("epochs", "lora_rank", "batch", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if not self.lr > 0 or self.hidden_weight < 0:
            raise ValueError("--lr must be > 0 and --hidden-weight >= 0")
