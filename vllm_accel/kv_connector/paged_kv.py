"""Read and write the K/V of given token positions of one request in vLLM's paged KV cache.

The page layout depends on the backend: vLLM's CPU attention keeps a K tile then a V tile per
(page, head), in an ISA-specific order (``kv_cache_views_cpu``); the CUDA FlashAttention/Triton
backends keep K|V in the last dimension (``kv_cache_views_split_last_dim``). Both give
``[num_pages, page_size, H_kv, D]`` views that index like a dense array, so one gather/scatter
serves every layout. Layouts without such a view (CPU AMX packing) are refused when the caches
are registered, before any request runs.
"""

from __future__ import annotations

import torch

from vllm_accel.kernels.block_sparse_attention import (
    kv_cache_views_cpu,
    kv_cache_views_split_last_dim,
)

CPU_WRITABLE_ISAS = ("vec", "vec16", "plain")


class PagedLayerKV:
    """K/V views of one layer's cache, addressed by (block table, token positions)."""

    def __init__(self, kv_cache: torch.Tensor, block_size: int, cpu_isa: str | None):
        if cpu_isa is not None:
            if cpu_isa not in CPU_WRITABLE_ISAS:
                raise NotImplementedError(
                    f"ChunkReuseConnector: vLLM's CPU attention packs KV pages for the "
                    f"{cpu_isa!r} ISA, which the connector cannot write yet (supported: "
                    f"{', '.join(CPU_WRITABLE_ISAS)}); use --dtype float32 on this CPU")
            self.k, self.v = kv_cache_views_cpu(kv_cache, isa=cpu_isa)
        else:
            self.k, self.v = kv_cache_views_split_last_dim(kv_cache)
        if self.k.shape[1] != block_size:
            raise ValueError(f"ChunkReuseConnector: KV pages hold {self.k.shape[1]} tokens but "
                             f"the scheduler's block size is {block_size}")
        self.block_size = block_size

    def _slots(self, block_table: torch.Tensor, positions: torch.Tensor):
        pages = block_table[torch.div(positions, self.block_size, rounding_mode="floor")]
        return pages, positions % self.block_size

    def read(self, block_table: torch.Tensor, positions: torch.Tensor):
        """``(k, v)``, each ``[n, H_kv, D]`` (copies)."""
        pages, offsets = self._slots(block_table, positions)
        return self.k[pages, offsets], self.v[pages, offsets]

    def write(self, block_table: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        pages, offsets = self._slots(block_table, positions)
        if k is not None:
            self.k[pages, offsets] = k.to(self.k.dtype)
        if v is not None:
            self.v[pages, offsets] = v.to(self.v.dtype)
