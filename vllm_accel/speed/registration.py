"""Route vLLM's Llama and Qwen2 architectures through vllm_accel's model transforms.

Called by the plugin in every vLLM process; cheap: it registers module paths (vLLM imports
:mod:`vllm_accel.speed.model` only when it builds such a model). Without
``--attention-backend ACCEL_SPEED`` (or the chunk-reuse connector) the registered classes
construct vLLM's own classes, unchanged (``vllm_accel.model_transforms``).
"""

from __future__ import annotations

import logging
from typing import Any

NAME = "ACCEL_SPEED"
#: vLLM architecture name -> the class that picks the model transform (``module:Class``).
ARCHITECTURES = {
    "LlamaForCausalLM": "vllm_accel.model_transforms:AccelLlamaForCausalLM",
    "Qwen2ForCausalLM": "vllm_accel.model_transforms:AccelQwen2ForCausalLM",
}


def speed_selected(vllm_config: Any) -> bool:
    """Whether this engine runs with ``--attention-backend ACCEL_SPEED``."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return getattr(backend, "name", None) == NAME


def register() -> None:
    """What every vLLM process needs for SPEED: the model classes and the upper KV-cache spec
    (the scheduler process builds its block manager, the worker its pages)."""
    from vllm_accel.speed.kv_spec import register_speed_kv_spec

    register_architectures()
    register_speed_kv_spec()


def register_architectures() -> None:
    from vllm import ModelRegistry

    # vLLM warns on every overwrite; these overwrites are intended and happen in every
    # process, so silence that one logger while registering.
    registry_logger = logging.getLogger("vllm.model_executor.models.registry")
    level = registry_logger.level
    registry_logger.setLevel(logging.ERROR)
    try:
        for arch, path in ARCHITECTURES.items():
            ModelRegistry.register_model(arch, path)
    finally:
        registry_logger.setLevel(level)
