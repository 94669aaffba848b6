"""``ACCEL_SPEED``: the attention backend of SPEED (shallow prefill, deep decode) on CPU, and the
Builder/Impl roles its CUDA classes share (:mod:`vllm_accel.speed.backend_cuda`).

One backend serves both KV-cache groups of a SPEED model (:mod:`vllm_accel.speed.model` gives
the upper layers a :class:`~vllm_accel.speed.kv_spec.SpeedUpperSpec`, so vLLM makes them a
group of their own with its own block table):

* lower layers (a ``FullAttentionSpec`` group): vLLM's CPU builder and kernel, unchanged;
* upper layers: :class:`SpeedMetadataBuilder` selects the step's *upper-active* tokens (anchors,
  each request's last prompt token, decode tokens: :mod:`vllm_accel.speed.rows`)
  and describes them (:class:`SpeedUpperMetadata`); the model runs its upper layers on exactly
  those rows (``SpeedUpperMetadata.rows``), and :class:`SpeedImpl` writes their K/V into the
  upper group's pages (at their own slots: vLLM hands ``do_kv_cache_update`` one slot per
  token of the step) and attends over the visible keys only
  (``kernels.speed_attention``: planned once per step, at the first upper layer, run in
  each). The pages between the anchor and the
  last prompt token are never written nor read (the block manager maps them to the null
  block).

Per-request prompt lengths come from :mod:`vllm_accel.attention.step_requests` (runtime patch
``attention_step_requests``, applied by the SPEED model in the worker).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadataBuilder

from vllm_accel.attention import step_requests
from vllm_accel.attention.cpu_feature import CpuFeatureBackend, refuse_unsupported_attention
from vllm_accel.kernels.block_sparse_attention import kv_cache_views_cpu
from vllm_accel.kernels.speed_attention import (
    plan_speed_upper_attention,
    run_speed_upper_attention,
)
from vllm_accel.speed.kv_spec import SpeedUpperSpec
from vllm_accel.speed.registration import NAME
from vllm_accel.speed.rows import select_upper_rows


class SpeedBackend(CpuFeatureBackend):
    """SPEED on vLLM's CPU platform: dense lower layers, anchor + decode-only upper layers."""

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[SpeedImpl]:
        return SpeedImpl

    @staticmethod
    def get_builder_cls() -> type[SpeedMetadataBuilder]:
        return SpeedMetadataBuilder


@dataclass
class SpeedUpperMetadata:
    """The step's upper-active tokens, shared by every upper layer."""

    num_actual_tokens: int  # upper-active tokens this step
    rows: torch.Tensor  # long [n]: their rows among the step's tokens (the model gathers them)
    query_start_loc: list[int]  # [R + 1] over the upper-active tokens
    query_positions: torch.Tensor  # long [n]
    seq_lens: list[int]  # [R] context + new tokens (absolute positions)
    prompt_lens: list[int]  # [R]
    block_table: torch.Tensor  # [R, max_pages] of the upper group
    slot_mapping: torch.Tensor  # [n] where their K/V go
    anchor_tokens: int
    #: the attention plan, made by the first upper layer (its type is the platform kernel's)
    plan: Any = None


def select_upper_tokens(cm: CommonAttentionMetadata, prompt_lens: torch.Tensor,
                        anchor_tokens: int) -> SpeedUpperMetadata:
    """Which of the step's tokens run the upper layers, and their attention metadata."""
    num_reqs = cm.num_reqs
    qsl = cm.query_start_loc_cpu[: num_reqs + 1].to(torch.long)
    q_lens = qsl[1:] - qsl[:-1]
    seq_lens = cm.seq_lens[:num_reqs].cpu().to(torch.long)
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
    positions = (seq_lens - q_lens)[req_of_token] + torch.arange(int(qsl[-1])) \
        - qsl[:-1][req_of_token]
    upper = select_upper_rows(positions, qsl, prompt_lens, anchor_tokens)
    rows = upper.rows
    return SpeedUpperMetadata(
        num_actual_tokens=int(rows.numel()),
        rows=rows,
        query_start_loc=upper.query_start_loc.tolist(),
        query_positions=positions[rows],
        seq_lens=seq_lens.tolist(),
        prompt_lens=prompt_lens.tolist(),
        block_table=cm.block_table_tensor[:num_reqs],
        slot_mapping=cm.slot_mapping[rows.to(cm.slot_mapping.device)],
        anchor_tokens=anchor_tokens,
    )


class SpeedBuilderMixin:
    """The dense builder for the lower group; :class:`SpeedUpperMetadata` for the upper group
    (mixed into the platform's dense builder: CPU here, FlashAttention/Triton on CUDA)."""

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.upper = isinstance(kv_cache_spec, SpeedUpperSpec)
        if self.upper:
            self.anchor_tokens = kv_cache_spec.anchor_tokens
            # vLLM reuses one group's metadata for another group of the same spec by swapping
            # in its block table and slot mapping (FlashAttention's builder allows it); ours
            # holds the upper rows' own slots and a plan made from the block table: build anew
            self.supports_update_block_table = False

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False):
        if not self.upper:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        return select_upper_tokens(cm, step_requests.prompt_lens(cm.num_reqs),
                                   self.anchor_tokens)


class SpeedImplMixin:
    """The dense Impl in the lower layers; in the upper layers the K/V write of the
    upper-active rows and :meth:`upper_attention` (the platform's visible-keys kernel)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        refuse_unsupported_attention(self, NAME, "SPEED's upper-layer attention")

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """vLLM calls this before ``forward`` with the group's slot mapping, one slot per token
        of the step; an upper layer holds only the upper-active rows, whose slots are in its
        metadata."""
        metadata = get_forward_context().attn_metadata
        meta = metadata.get(layer.layer_name) if isinstance(metadata, dict) else None
        if isinstance(meta, SpeedUpperMetadata):
            n = meta.num_actual_tokens
            key, value, slot_mapping = key[:n], value[:n], meta.slot_mapping
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if not isinstance(attn_metadata, SpeedUpperMetadata):  # lower layer, or warm-up
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{NAME}: fused output quantization is not supported")
        n = attn_metadata.num_actual_tokens
        if n == 0:
            return output
        out = self.upper_attention(layer, query[:n], kv_cache, attn_metadata)
        output[:n].copy_(out.reshape(output[:n].shape))
        return output

    def upper_attention(self, layer, query: torch.Tensor, kv_cache: torch.Tensor,
                        meta: SpeedUpperMetadata) -> torch.Tensor:
        raise NotImplementedError


class SpeedMetadataBuilder(SpeedBuilderMixin, CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata for the lower group; :class:`SpeedUpperMetadata` for the upper."""


class SpeedImpl(SpeedImplMixin, CPUAttentionBackendImpl):
    """vLLM's CPU kernel in the lower layers; the visible-keys kernel in the upper layers."""

    def upper_attention(self, layer, query, kv_cache, meta):
        k_pages, v_pages = kv_cache_views_cpu(kv_cache, isa=layer.isa)
        if meta.plan is None:
            meta.plan = plan_speed_upper_attention(
                meta.query_positions, meta.query_start_loc, meta.block_table, meta.seq_lens,
                meta.prompt_lens, meta.anchor_tokens, k_pages.shape[1], query.device)
        return run_speed_upper_attention(meta.plan, query, k_pages, v_pages, self.scale)
