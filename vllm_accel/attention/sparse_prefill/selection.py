"""The plan step of one layer: which key blocks each query block of a long prefill reads.

A :class:`LayerSelector` turns the ``sparse_prefill`` knobs of one layer (scoring method and
budgets, uniform or one per KV head) into ``vllm_accel.kernels`` calls:

* uniform budgets: one ``block_scoring.select_blocks`` (or ``attention_oracle``'s
  ``oracle_select_blocks`` for ``method="oracle"``) call for all heads;
* per-KV-head budgets: one call per KV head, each scoring only that head (its query-head group
  and its keys) under its own budget, merged into one ``BlockSelection``. The cost is the same
  as one call: every head is scored once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_accel.kernels.attention_oracle import dense_block_mass, oracle_select_blocks
from vllm_accel.kernels.block_scoring import (
    BlockScoringConfig,
    antidiagonal_block_mass,
    mean_pooled_block_mass,
    select_blocks,
    select_blocks_with,
)
from vllm_accel.kernels.block_sparse_attention import BlockSelection, QueryBlocks

from .config import SparsePrefillConfig


def _scoring_config(cfg: SparsePrefillConfig, tau, density, max_blocks) -> BlockScoringConfig:
    return BlockScoringConfig(
        method="mean_pool" if cfg.method == "mean_pool" else "antidiagonal",
        query_block_size=cfg.query_block_size,
        key_block_size=cfg.key_block_size,
        stride=cfg.stride,
        tau=tau,
        density=density,
        max_blocks=None if max_blocks is None else int(max_blocks),
        num_sink_blocks=cfg.num_sink_blocks,
        num_local_blocks=cfg.num_local_blocks,
        gqa=cfg.gqa,
    )


@dataclass(frozen=True)
class LayerSelector:
    """Scoring method and budgets of one layer; ``configs`` has one entry (all heads) or one
    per KV head."""

    method: str
    configs: tuple[BlockScoringConfig, ...]
    dense_tail_blocks: int = 0

    @classmethod
    def for_layer(cls, cfg: SparsePrefillConfig, budget: dict[str, Any],
                  num_kv_heads: int) -> LayerSelector:
        per_head = any(isinstance(v, tuple) for v in budget.values())
        if not per_head:
            return cls(cfg.method, (_scoring_config(cfg, budget["tau"], budget["density"],
                                                    budget["max_blocks"]),),
                       cfg.dense_tail_blocks)

        def head_value(key, h):
            v = budget[key]
            return v[h] if isinstance(v, tuple) else v

        return cls(cfg.method, tuple(
            _scoring_config(cfg, head_value("tau", h), head_value("density", h),
                            head_value("max_blocks", h))
            for h in range(num_kv_heads)), cfg.dense_tail_blocks)

    @property
    def per_head(self) -> bool:
        return len(self.configs) > 1

    def describe(self) -> str:
        def one(c: BlockScoringConfig) -> str:
            parts = [f"{k}={getattr(c, k)}" for k in ("tau", "density", "max_blocks")
                     if getattr(c, k) is not None]
            return ",".join(parts) or "all blocks"

        if not self.per_head:
            return one(self.configs[0])
        return "per KV head [" + "; ".join(one(c) for c in self.configs) + "]"

    def select(self, query: torch.Tensor, k_cache, block_table: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
               query_blocks: QueryBlocks) -> BlockSelection:
        """Selection for a batch of prefill chunks (``query [T, Hq, D]`` of those chunks)."""
        if not self.per_head:
            cfg = self.configs[0]
            if self.method == "oracle":
                sel = oracle_select_blocks(query, k_cache, block_table, seq_lens,
                                           query_start_loc, cfg, scale=scale,
                                           query_blocks=query_blocks)
            else:
                sel = select_blocks(query, k_cache, block_table, seq_lens, query_start_loc, cfg,
                                    scale=scale, query_blocks=query_blocks)
        else:
            sel = self._select_per_head(query, k_cache, block_table, seq_lens, query_start_loc,
                                        scale, query_blocks)
        return with_dense_tail(sel, self.dense_tail_blocks)

    def _mass_fn(self, head: int, cfg: BlockScoringConfig, scale: float):
        if self.method == "oracle":
            gqa = "per_query_head" if cfg.gqa == "per_query_head" else "mean_mass"
            return lambda q, k, ctx: dense_block_mass(
                q, k[head : head + 1], ctx, cfg.query_block_size, cfg.key_block_size,
                scale=scale, gqa=gqa, chunk_bytes=cfg.chunk_bytes)
        fn = mean_pooled_block_mass if cfg.method == "mean_pool" else antidiagonal_block_mass
        return lambda q, k, ctx: fn(q, k[head : head + 1], ctx, cfg, scale)

    def _select_per_head(self, query, k_cache, block_table, seq_lens, query_start_loc, scale,
                         query_blocks) -> BlockSelection:
        num_kv_heads = len(self.configs)
        group = query.shape[1] // num_kv_heads
        parts = []
        for h, cfg in enumerate(self.configs):
            q_h = query[:, h * group : (h + 1) * group]
            parts.append(select_blocks_with(
                self._mass_fn(h, cfg, scale), q_h, k_cache, block_table, seq_lens,
                query_start_loc, cfg, query_blocks=query_blocks))
        width = max(p.block_indices.shape[-1] for p in parts)
        indices = torch.cat([
            torch.nn.functional.pad(p.block_indices, (0, width - p.block_indices.shape[-1]),
                                    value=-1) for p in parts], dim=1)
        counts = torch.cat([p.block_counts for p in parts], dim=1)
        return BlockSelection.from_indices(indices, counts, query_blocks,
                                           self.configs[0].key_block_size)


def with_dense_tail(selection: BlockSelection, num_blocks: int) -> BlockSelection:
    """``selection`` with the last ``num_blocks`` query blocks of every sequence attending to
    every causal key block."""
    qb = selection.query_blocks
    if num_blocks <= 0 or qb.num_blocks == 0:
        return selection
    tail = [row for b in range(len(qb.seq_lens))
            for row in range(max(qb.seq_block_offsets[b], qb.seq_block_offsets[b + 1] - num_blocks),
                             qb.seq_block_offsets[b + 1])]
    if not tail:
        return selection
    mask = selection.to_mask()
    mask[torch.tensor(tail, dtype=torch.long, device=mask.device)] = True
    return BlockSelection.from_mask(mask, qb, selection.key_block_size)
