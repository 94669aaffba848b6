"""``ACCEL_SPARSE_PREFILL``: block-sparse attention for long prefills, vLLM's kernel elsewhere.

Roles (subclasses of vLLM's CPU backend, ``vllm/v1/attention/backends/cpu_attn.py``):

* :class:`SparsePrefillBackend` — the name, and the configurations it refuses at start-up
  (through ``validate_configuration``, which the CPU selection patch and the CUDA platform
  call): KV-cache dtypes other than the model dtype, sliding windows, non-causal and
  non-decoder attention, sinks, and every platform but CPU.
* :class:`SparsePrefillMetadataBuilder` — sets ``reorder_batch_threshold = 1`` (vLLM puts
  decodes first), splits each step with ``split_decodes_and_prefills`` and sorts the prefill
  requests by length: those whose context + chunk reach ``threshold`` tokens get a sparse
  *plan* (their block table, lengths and ``QueryBlocks``, shared by all layers); the others
  and all decodes get vLLM's own CPU metadata, built by the parent builder for just those
  requests. The parent's metadata for the whole batch is built too when a layer is kept dense.
* :class:`SparsePrefillImpl` — per layer: the dense requests through vLLM's CPU kernel (the
  parent impl with the sliced metadata), the long prefills through ``select_blocks`` +
  ``block_sparse_attention`` reading the paged cache in place
  (``kv_cache_views_cpu(kv_cache, isa=layer.isa)``). Layers in ``dense_layers`` run the
  parent impl on the whole batch.

Nothing falls back silently: what the kernel cannot do fails at start-up with the reason. The
builder also checks, once per process, that it reads vLLM's CPU page layout correctly for the
ISA vLLM picked (it writes a scratch page with vLLM's own writer and reads it back through the
views) and refuses to start if not.

Statistics (time, density) per step and per process: :mod:`.stats`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from vllm_accel.attention.cpu_feature import CpuFeatureBackend, refuse_unsupported_attention
from vllm_accel.config import AccelConfigError, knob, load_section
from vllm_accel.kernels.block_sparse_attention import (
    QueryBlocks,
    block_sparse_attention,
    kv_cache_views_cpu,
)

from .config import SECTION, SparsePrefillConfig
from .selection import LayerSelector
from .stats import StepStats, logger

NAME = "ACCEL_SPARSE_PREFILL"
#: vLLM CPU attention ISAs whose KV page layout ``kv_cache_views_cpu`` reads.
SUPPORTED_ISAS = ("vec", "vec16", "amx")

_logged: set[str] = set()


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


def layer_index(layer_name: str) -> int | None:
    """The decoder-layer index in a module name (``model.layers.12.self_attn.attn`` -> 12)."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", layer_name)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------------------------


class SparsePrefillBackend(CpuFeatureBackend):
    """Block-sparse prefill for long prompts; vLLM's CPU attention for the rest."""

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[SparsePrefillImpl]:
        return SparsePrefillImpl

    @staticmethod
    def get_builder_cls() -> type[SparsePrefillMetadataBuilder]:
        return SparsePrefillMetadataBuilder


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------


@dataclass
class DensePart:
    """Requests that run vLLM's CPU kernel in a sparse layer: their tokens and metadata."""

    tokens: slice | torch.Tensor  # rows of query/output (a slice when contiguous)
    metadata: CPUAttentionMetadata


@dataclass
class SparsePlan:
    """Long prefill requests of one step, shared by every sparse layer."""

    tokens: slice | torch.Tensor
    num_tokens: int
    query_start_loc: torch.Tensor  # int32 [B+1], rebased to the sparse tokens
    seq_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # [B, max_pages]
    query_blocks: QueryBlocks


@dataclass
class SparsePrefillMetadata:
    """What one step gives every layer of the KV-cache group."""

    num_actual_tokens: int
    full: CPUAttentionMetadata | None  # vLLM's metadata for the whole batch (dense layers)
    dense: DensePart | None  # the requests below the threshold and the decodes
    sparse: SparsePlan | None  # the long prefills (None: the whole step is dense)
    step: StepStats


def _token_rows(qsl: list[int], reqs: list[int]) -> slice | torch.Tensor:
    """Rows of ``reqs``' tokens: a slice if the requests are consecutive, else an index."""
    if reqs == list(range(reqs[0], reqs[-1] + 1)):
        return slice(qsl[reqs[0]], qsl[reqs[-1] + 1])
    return torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in reqs])


def subset_common_metadata(cm: CommonAttentionMetadata, reqs: list[int],
                           tokens: slice | torch.Tensor) -> CommonAttentionMetadata:
    """``cm`` restricted to requests ``reqs`` (and their ``tokens``), rebased to row 0."""
    idx = torch.tensor(reqs, dtype=torch.long)
    qsl_cpu = cm.query_start_loc_cpu
    query_lens = (qsl_cpu[1:] - qsl_cpu[:-1])[idx]
    sub_qsl = torch.zeros(len(reqs) + 1, dtype=qsl_cpu.dtype)
    torch.cumsum(query_lens, 0, out=sub_qsl[1:])
    seq_lens = cm.seq_lens.index_select(0, idx.to(cm.seq_lens.device))
    return CommonAttentionMetadata(
        query_start_loc=sub_qsl.to(cm.query_start_loc.device),
        query_start_loc_cpu=sub_qsl,
        seq_lens=seq_lens,
        num_reqs=len(reqs),
        num_actual_tokens=int(sub_qsl[-1]),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=cm.block_table_tensor.index_select(
            0, idx.to(cm.block_table_tensor.device)),
        slot_mapping=cm.slot_mapping[tokens],
        causal=cm.causal,
    )


def check_kv_cache_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int,
                          num_kv_heads: int) -> None:
    """Write two scratch pages with vLLM's own CPU cache writer for ``isa`` and read them back
    through ``kv_cache_views_cpu``; raise at start-up if they differ (never read a layout
    wrongly)."""
    from vllm import _custom_ops as ops

    if isa not in SUPPORTED_ISAS:
        raise RuntimeError(
            f"{NAME}: vLLM's CPU attention uses the {isa!r} ISA here, whose KV page layout the "
            f"block-sparse kernel cannot read yet (supported: {', '.join(SUPPORTED_ISAS)}). "
            f"Use --attention-backend ACCEL_BASE or drop the flag on this CPU.")
    gen = torch.Generator().manual_seed(0)
    n = 2 * block_size - 3
    k = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
    cache = torch.zeros(2, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    tiles = cache.view(2, num_kv_heads, 2 * block_size, head_size)
    key_tiles, value_tiles = tiles.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_tiles, value_tiles, torch.arange(n), isa)
    k_view, v_view = kv_cache_views_cpu(cache, isa=isa)
    pages = torch.arange(2)
    k_back = k_view.index_select(0, pages).reshape(2 * block_size, num_kv_heads, head_size)[:n]
    v_back = v_view.index_select(0, pages).reshape(2 * block_size, num_kv_heads, head_size)[:n]
    if not (torch.equal(k_back, k) and torch.equal(v_back, v)):
        raise RuntimeError(
            f"{NAME}: self-check failed: the KV pages vLLM writes for ISA {isa!r} (dtype "
            f"{dtype}, block {block_size}, head size {head_size}) do not read back through "
            f"kv_cache_views_cpu. Refusing to run rather than attend to the wrong keys; use "
            f"--attention-backend ACCEL_BASE and report this CPU.")


class SparsePrefillMetadataBuilder(CPUAttentionMetadataBuilder):
    """Splits each step into dense requests (vLLM's metadata) and long prefills (a plan)."""

    # decodes first, then extends and prefills (the runner reorders the batch)
    reorder_batch_threshold: ClassVar[int | None] = 1

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config: SparsePrefillConfig = load_section(SECTION, vllm_config.additional_config)
        model_config = vllm_config.model_config
        self.config.check_model(model_config.get_total_num_hidden_layers(),
                                model_config.get_total_num_kv_heads())
        if (vllm_config.parallel_config.tensor_parallel_size > 1
                and self.config.layer_budgets is not None):
            raise AccelConfigError(
                f"{knob(SECTION, 'layer_budgets')}: per-layer/per-head budgets need "
                f"tensor_parallel_size=1")
        self.num_group_layers = len(layer_names)
        self.sparse_layers = [name for name in layer_names
                              if not self.config.is_dense_layer(layer_index(name))]
        if self.config.method != "dense":
            check_kv_cache_layout(self.isa, self.dtype, self.block_size, self.head_dim,
                                  self.num_kv_heads)
        self._log_configuration(layer_names)

    def _log_configuration(self, layer_names: list[str]) -> None:
        c = self.config
        if c.method == "dense":
            _log_once("config", "%s: method=dense: every request of every layer runs vLLM's CPU "
                      "attention kernel (timing baseline)", NAME)
            return
        budget = ", ".join(f"{k}={getattr(c, k)}" for k in ("tau", "density", "max_blocks")
                           if getattr(c, k) is not None) or "all blocks"
        dense = [layer_index(n) for n in layer_names if n not in self.sparse_layers]
        _log_once(
            "config",
            "%s: prefills with context+chunk >= %d tokens run block-sparse attention in %d of "
            "%d layers (method %s, %s%s, blocks %dx%d, %d sink + %d local block(s), ISA %s); "
            "dense (vLLM's CPU kernel): layers %s, shorter prefills and all decodes",
            NAME, c.threshold, len(self.sparse_layers), len(layer_names), c.method, budget,
            ", per-layer budgets" if c.layer_budgets else "", c.query_block_size,
            c.key_block_size, c.num_sink_blocks, c.num_local_blocks, self.isa, dense or "none")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SparsePrefillMetadata:
        cm = common_attn_metadata
        step = StepStats(num_layers=self.num_group_layers)
        qsl = cm.query_start_loc_cpu.tolist()
        num_reqs = cm.num_reqs
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
            cm, decode_threshold=self.reorder_batch_threshold)
        step.decode_tokens = num_decode_tokens
        long_reqs: list[int] = []
        if (self.config.method != "dense" and self.sparse_layers and cm.causal is True
                and num_decodes < num_reqs):
            seq_lens = cm.seq_lens.tolist()
            long_reqs = [r for r in range(num_decodes, num_reqs)
                         if seq_lens[r] >= self.config.threshold and qsl[r + 1] - qsl[r] > 1]
        step.dense_prefill_tokens = qsl[num_reqs] - num_decode_tokens
        if not long_reqs:
            full = super().build(common_prefix_len, cm, fast_build)
            return SparsePrefillMetadata(cm.num_actual_tokens, full, None, None, step)

        long_set = set(long_reqs)
        dense_reqs = [r for r in range(num_reqs) if r not in long_set]
        sparse = self._plan(cm, qsl, long_reqs)
        dense = None
        if dense_reqs:
            tokens = _token_rows(qsl, dense_reqs)
            dense = DensePart(tokens, super().build(
                common_prefix_len, subset_common_metadata(cm, dense_reqs, tokens), fast_build))
        full = (super().build(common_prefix_len, cm, fast_build)
                if len(self.sparse_layers) < self.num_group_layers else None)
        step.sparse_requests = len(long_reqs)
        step.sparse_tokens = sparse.num_tokens
        step.sparse_max_seq_len = max(sparse.query_blocks.seq_lens)
        step.sparse_context_tokens = sum(sparse.query_blocks.seq_lens) - sparse.num_tokens
        step.dense_prefill_tokens -= sparse.num_tokens
        return SparsePrefillMetadata(cm.num_actual_tokens, full, dense, sparse, step)

    def _plan(self, cm: CommonAttentionMetadata, qsl: list[int],
              reqs: list[int]) -> SparsePlan:
        tokens = _token_rows(qsl, reqs)
        sub = subset_common_metadata(cm, reqs, tokens)
        seq_lens = sub.seq_lens.to(torch.int32)
        query_start_loc = sub.query_start_loc_cpu.to(torch.int32)
        return SparsePlan(
            tokens=tokens,
            num_tokens=sub.num_actual_tokens,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=sub.block_table_tensor,
            query_blocks=QueryBlocks.build(seq_lens, query_start_loc,
                                           self.config.query_block_size,
                                           device=cm.seq_lens.device),
        )


# --------------------------------------------------------------------------------------------
# Impl
# --------------------------------------------------------------------------------------------


class SparsePrefillImpl(CPUAttentionBackendImpl):
    """Dense requests through vLLM's CPU kernel, long prefills through the sparse kernels."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        refuse_unsupported_attention(self, NAME, "the block-sparse prefill kernel")
        self.config: SparsePrefillConfig = load_section(
            SECTION, get_current_vllm_config().additional_config)
        self._layer_index: dict[str, int | None] = {}
        self._selectors: dict[int | None, LayerSelector] = {}

    def _selector(self, index: int | None) -> LayerSelector:
        sel = self._selectors.get(index)
        if sel is None:
            sel = LayerSelector.for_layer(self.config, self.config.budget_for_layer(index),
                                          self.num_kv_heads)
            self._selectors[index] = sel
        return sel

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if not isinstance(attn_metadata, SparsePrefillMetadata):  # None: profiling run
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        meta = attn_metadata
        name = layer.layer_name
        if name not in self._layer_index:
            self._layer_index[name] = layer_index(name)
        index = self._layer_index[name]
        step = meta.step
        if meta.sparse is None or self.config.is_dense_layer(index):
            t0 = time.perf_counter()
            super().forward(layer, query, key, value, kv_cache, meta.full, output,
                            output_scale, output_block_scale)
            step.add_dense(time.perf_counter() - t0)
        else:
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError(f"{NAME}: fused output quantization is not supported")
            if meta.dense is not None:
                self._forward_dense_part(layer, query, key, value, kv_cache, meta.dense, output,
                                         step)
            self._forward_sparse(layer, index, query, kv_cache, meta.sparse, output, step)
        step.layer_done(self.config.stats_path)
        return output

    def _forward_dense_part(self, layer, query, key, value, kv_cache, part: DensePart, output,
                            step: StepStats) -> None:
        t0 = time.perf_counter()
        if isinstance(part.tokens, slice):
            super().forward(layer, query[part.tokens], key, value, kv_cache, part.metadata,
                            output[part.tokens])
        else:
            out = output.new_empty((part.tokens.numel(), *output.shape[1:]))
            super().forward(layer, query.index_select(0, part.tokens), key, value, kv_cache,
                            part.metadata, out)
            output.index_copy_(0, part.tokens, out)
        step.add_dense(time.perf_counter() - t0)

    def _forward_sparse(self, layer, index: int | None, query, kv_cache, plan: SparsePlan,
                        output, step: StepStats) -> None:
        contiguous_rows = isinstance(plan.tokens, slice)
        q = (query[plan.tokens] if contiguous_rows else query.index_select(0, plan.tokens))
        q = q.contiguous()
        k_cache, v_cache = kv_cache_views_cpu(kv_cache, isa=layer.isa)
        t0 = time.perf_counter()
        selection = self._selector(index).select(
            q, k_cache, plan.block_table, plan.seq_lens, plan.query_start_loc, self.scale,
            plan.query_blocks)
        t1 = time.perf_counter()
        out = output[plan.tokens] if contiguous_rows else None
        if out is None or not out.is_contiguous():
            out = output.new_empty((plan.num_tokens, *output.shape[1:]))
        block_sparse_attention(q, k_cache, v_cache, selection, plan.block_table, plan.seq_lens,
                               plan.query_start_loc, scale=self.scale, out=out,
                               backend="torch")
        if contiguous_rows:
            if out.data_ptr() != output[plan.tokens].data_ptr():
                output[plan.tokens] = out
        else:
            output.index_copy_(0, plan.tokens, out)
        t2 = time.perf_counter()
        causal = float(plan.query_blocks.num_causal_key_blocks(selection.key_block_size).sum())
        step.add_sparse(index, t1 - t0, t2 - t1, float(selection.block_counts.sum()),
                        causal * selection.num_heads)
