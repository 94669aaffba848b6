"""Low-rank adapters on ``nn.Linear`` layers, merged into plain weights at the end.

``W x + (alpha / r) * B A x`` with ``A`` small random and ``B`` zero, so an attached adapter
starts as the identity change. :func:`merge` folds ``(alpha / r) * B @ A`` into ``W`` and puts the
original ``nn.Linear`` back, so the saved model is an ordinary checkpoint any loader (vLLM
included) reads. A dozen lines of our own instead of ``peft``: nothing to pin, and the merged
result is exact by construction.
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: The projections of a Llama / Qwen2 decoder layer that get adapters.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator=None) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        dev = base.weight.device
        a = torch.empty(rank, base.in_features, device=dev, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_a = nn.Parameter(a)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=dev,
                                               dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = (x.to(self.lora_a.dtype) @ self.lora_a.t()) @ self.lora_b.t()
        return self.base(x) + (self.scale * delta).to(x.dtype)

    def merged_weight(self) -> torch.Tensor:
        delta = self.scale * (self.lora_b @ self.lora_a)
        return (self.base.weight.float() + delta).to(self.base.weight.dtype)


def attach(model, layer_ids, rank: int, alpha: float, seed: int = 0) -> list[str]:
    """Freeze ``model`` and put adapters on :data:`TARGETS` of decoder layers ``layer_ids``.

    Returns the adapted modules' qualified names (the keys of :func:`adapter_state`).
    """
    if rank < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {rank}")
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    names = []
    for i in layer_ids:
        layer = model.model.layers[i]
        for part in ("self_attn", "mlp"):
            parent = getattr(layer, part)
            for attr in TARGETS:
                base = getattr(parent, attr, None)
                if isinstance(base, nn.Linear):
                    setattr(parent, attr, LoRALinear(base, rank, alpha, generator))
                    names.append(f"model.layers.{i}.{part}.{attr}")
    if not names:
        raise ValueError("no adaptable projections found in the chosen layers")
    return names


def adapters(model) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The trainable tensors only (what a checkpoint needs)."""
    return {f"{name}.{p}": getattr(m, p).detach().clone()
            for name, m in adapters(model).items() for p in ("lora_a", "lora_b")}


def load_adapter_state(model, state: dict[str, torch.Tensor]) -> None:
    mods = adapters(model)
    expected = {f"{n}.{p}" for n in mods for p in ("lora_a", "lora_b")}
    if set(state) != expected:
        raise ValueError("checkpoint adapters do not match this model / layer choice")
    for key, value in state.items():
        name, param = key.rsplit(".", 1)
        getattr(mods[name], param).data.copy_(value)


def merge(model) -> int:
    """Fold every adapter into its base weight and restore the plain ``nn.Linear`` modules."""
    count = 0
    for name, module in list(adapters(model).items()):
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        with torch.no_grad():
            module.base.weight.copy_(module.merged_weight())
        setattr(parent, attr, module.base)
        count += 1
    return count
