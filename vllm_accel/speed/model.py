"""SPEED's model transform: prompt tokens skip the upper layers entirely.

The plugin registers :class:`SpeedLlamaForCausalLM` and :class:`SpeedQwen2ForCausalLM` under
vLLM's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` architecture names (:mod:`.registration`).
Constructing one without ``--attention-backend ACCEL_SPEED`` returns vLLM's own class,
untouched (``__new__``); with it, the model is vLLM's, with two changes:

* ``forward`` runs the lower layers (``index < cut``) on every token, then gathers the rows the
  upper group's metadata names (``SpeedUpperMetadata.rows``: anchors, each request's last
  prompt token, decode tokens), runs the upper layers on those rows only — attention, MLP and
  norms — and scatters them back before the final norm. Prompt tokens' upper-layer compute is
  skipped, not masked. The forward runs eagerly (the compiled ``LlamaModel.forward`` is not
  used: the gathered row count changes every step).
* the upper layers' attention reports a :class:`~vllm_accel.speed.kv_spec.SpeedUpperSpec`, so
  vLLM puts them in a KV-cache group of their own whose block manager gives the skipped prompt
  range no memory.

Same pattern as vLLM's YOCO fast prefill (``gemma3n.py`` ``fast_prefill_forward``), applied to a
stock checkpoint. Reference (token-for-token oracle): :mod:`vllm_accel.speed.reference`.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

from vllm_accel._patches import attention_step_requests
from vllm_accel.config import AccelConfigError
from vllm_accel.log import get_logger
from vllm_accel.speed.config import (
    ADAPTED_CONFIG_KEY,
    SpeedConfig,
    adapted_knobs,
    resolve_speed_config,
)
from vllm_accel.speed.registration import NAME, speed_selected

logger = get_logger("speed")


def _upper_kv_cache_spec(anchor_tokens: int):
    """``Attention.get_kv_cache_spec`` for an upper layer: the layer's own spec, re-typed."""
    from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

    from vllm_accel.speed.kv_spec import SpeedUpperSpec

    def get_kv_cache_spec(self, vllm_config):
        spec = type(self).get_kv_cache_spec(self, vllm_config)
        if type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
            raise AccelConfigError(f"--attention-backend {NAME}: layer {self.layer_name} has "
                                   f"a {type(spec).__name__} KV cache; SPEED needs full "
                                   f"attention in every layer")
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(AttentionSpec)}
        return SpeedUpperSpec(**fields, anchor_tokens=anchor_tokens)

    return get_kv_cache_spec


def _log_adapted(config: SpeedConfig, sources: dict[str, str], hf_config: Any) -> None:
    """Say where the cut came from; warn when a flag overrides what the model was adapted for."""
    adapted = adapted_knobs(hf_config)
    if not adapted:
        if sources["cut"] == "default":
            logger.info("%s: the model is not SPEED-adapted (no %s in its config); untuned "
                        "weights lose quality under SPEED, see `vllm-accel speed-adapt`",
                        NAME, ADAPTED_CONFIG_KEY)
        return
    for key, value in adapted.items():
        if sources[key] == "flag" and getattr(config, key) != value:
            logger.warning("%s: %s=%r overrides the model's adapted %s=%r; quality is only "
                           "measured at the adapted value", NAME, key, getattr(config, key),
                           key, value)
        elif sources[key] == "model":
            logger.info("%s: %s=%r from the adapted model's config", NAME, key, value)


class _SpeedMixin:
    """The SPEED forward over a vLLM decoder-only model with ``model.layers`` / ``model.norm``."""

    _vllm_class: type

    def __new__(cls, *, vllm_config: Any, prefix: str = "", **kwargs: Any):
        if not speed_selected(vllm_config):
            return cls._vllm_class(vllm_config=vllm_config, prefix=prefix, **kwargs)
        return super().__new__(cls)

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        config, sources = resolve_speed_config(vllm_config.additional_config,
                                               vllm_config.model_config.hf_config)
        _log_adapted(config, sources, vllm_config.model_config.hf_config)
        layers = self.model.layers
        num_layers = len(layers)
        if getattr(self.model, "start_layer", 0) != 0 or getattr(
                self.model, "end_layer", num_layers) != num_layers:
            raise AccelConfigError(f"--attention-backend {NAME} does not support pipeline "
                                   f"parallelism (--pipeline-parallel-size 1)")
        for flag, present in (("--speculative-config", vllm_config.speculative_config),
                              ("--kv-transfer-config", vllm_config.kv_transfer_config)):
            if present is not None:
                raise AccelConfigError(
                    f"--attention-backend {NAME} cannot be combined with {flag} yet (not "
                    f"implemented and tested together); drop one of the two")
        self.speed_num_lower = config.num_lower_layers(num_layers)
        self.speed_anchor_tokens = config.anchor_tokens
        spec_fn = _upper_kv_cache_spec(config.anchor_tokens)
        for layer in layers[self.speed_num_lower:]:
            attn = layer.self_attn.attn
            attn.get_kv_cache_spec = types.MethodType(spec_fn, attn)
        self._speed_first_upper = (layers[self.speed_num_lower].self_attn.attn.layer_name
                                   if self.speed_num_lower < num_layers else None)
        attention_step_requests.enable()
        logger.info(
            "%s: %s with %d of %d layers for prompt tokens (cut %s), %d anchor token(s); "
            "layers %d..%d run only anchors, last prompt tokens and decode tokens",
            NAME, type(self).__name__, self.speed_num_lower, num_layers, config.cut,
            config.anchor_tokens, self.speed_num_lower, num_layers - 1)

    def _upper_rows(self) -> torch.Tensor | None:
        """Rows that run the upper layers this step; None: all of them (warm-up, profiling)."""
        if self._speed_first_upper is None:
            return None
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batching is not used on CPU
            raise NotImplementedError(f"{NAME} does not support micro-batching")
        meta = metadata.get(self._speed_first_upper) if metadata else None
        return getattr(meta, "rows", None)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        model = self.model
        hidden = inputs_embeds if inputs_embeds is not None else model.embed_input_ids(input_ids)
        residual = None
        for layer in model.layers[: self.speed_num_lower]:
            hidden, residual = layer(positions, hidden, residual)
        upper = model.layers[self.speed_num_lower:]
        rows = self._upper_rows()
        # None: warm-up/profiling; every row (a decode-only step): no gather either
        if rows is None or rows.numel() == hidden.shape[0]:
            for layer in upper:
                hidden, residual = layer(positions, hidden, residual)
        elif rows.numel() > 0:
            rows = rows.to(hidden.device)
            h, r = hidden.index_select(0, rows), residual.index_select(0, rows)
            p = positions.index_select(-1, rows)
            for layer in upper:
                h, r = layer(p, h, r)
            hidden = hidden.index_copy(0, rows, h)
            residual = residual.index_copy(0, rows, r)
        hidden, _ = model.norm(hidden, residual)
        return hidden


class SpeedLlamaForCausalLM(_SpeedMixin, LlamaForCausalLM):
    _vllm_class = LlamaForCausalLM


class SpeedQwen2ForCausalLM(_SpeedMixin, Qwen2ForCausalLM):
    _vllm_class = Qwen2ForCausalLM
