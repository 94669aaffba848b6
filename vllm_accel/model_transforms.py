"""The classes vllm_accel registers under vLLM's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``
architecture names: each builds the model the engine's flags ask for.

* ``--attention-backend ACCEL_SPEED``: SPEED's transform (:mod:`vllm_accel.speed.model`);
* ``--kv-transfer-config`` with ``ChunkReuseConnector``: vLLM's own model, registered with the
  connector, which runs its decoder layers for selective recompute
  (:mod:`vllm_accel.kv_connector.blend`);
* anything else: vLLM's own model, untouched.

vLLM imports this module only when it builds one of these architectures.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

from vllm_accel.speed.registration import speed_selected

CHUNK_REUSE_CONNECTOR = "ChunkReuseConnector"


def chunk_reuse_selected(vllm_config: Any) -> bool:
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return getattr(transfer, "kv_connector", None) == CHUNK_REUSE_CONNECTOR


def _build(vllm_class: type, speed_class_name: str, vllm_config: Any, prefix: str,
           kwargs: dict[str, Any]) -> Any:
    if speed_selected(vllm_config):
        from vllm_accel.speed import model as speed_model

        return getattr(speed_model, speed_class_name)(vllm_config=vllm_config, prefix=prefix,
                                                      **kwargs)
    model = vllm_class(vllm_config=vllm_config, prefix=prefix, **kwargs)
    if chunk_reuse_selected(vllm_config):
        from vllm_accel.kv_connector.blend import register_model

        register_model(model)
    return model


class AccelLlamaForCausalLM(LlamaForCausalLM):
    def __new__(cls, *, vllm_config: Any, prefix: str = "", **kwargs: Any):
        return _build(LlamaForCausalLM, "SpeedLlamaForCausalLM", vllm_config, prefix, kwargs)


class AccelQwen2ForCausalLM(Qwen2ForCausalLM):
    def __new__(cls, *, vllm_config: Any, prefix: str = "", **kwargs: Any):
        return _build(Qwen2ForCausalLM, "SpeedQwen2ForCausalLM", vllm_config, prefix, kwargs)
