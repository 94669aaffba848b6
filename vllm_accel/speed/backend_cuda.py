"""``ACCEL_SPEED`` on CUDA: vLLM's dense GPU backend in the lower layers, the Triton visible-keys
kernel in the upper layers.

The same roles as the CPU backend (:mod:`vllm_accel.speed.backend`), mixed into the platform's
dense backend instead of vLLM's CPU one (``FLASH_ATTN`` where flash-attn imports, else
``TRITON_ATTN``: :func:`vllm_accel.attention.base.dense_backend_class`). Both keep K|V in the
last dimension of a ``[num_pages, H_kv, page_size, 2*D]`` layer cache, so the upper layers read
the strided views vLLM's own kernels read (``kv_cache_views_split_last_dim``) and
:func:`~vllm_accel.kernels.speed_attention.run_speed_upper_triton` walks only the anchor and
tail pages of each request (the skipped prompt pages are vLLM's null block).

CUDA graphs: the upper rows change every step (the model gathers them), so the builders say
``NEVER`` and vLLM runs the model eagerly.

:func:`speed_backend_on` builds the classes for a given dense backend; the tests build them on
``TritonAttentionBackend`` and run the upper path on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from functools import cache
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport

from vllm_accel.attention.cpu_feature import CausalDecoderOnly
from vllm_accel.kernels.block_sparse_attention import kv_cache_views_split_last_dim
from vllm_accel.kernels.speed_attention import plan_speed_upper_triton, run_speed_upper_triton
from vllm_accel.speed.backend import SpeedBuilderMixin, SpeedImplMixin, SpeedUpperMetadata
from vllm_accel.speed.registration import NAME


class SpeedTritonUpperMixin(SpeedImplMixin):
    """Upper layers: the Triton kernel over the dense backend's page views."""

    def upper_attention(self, layer, query: torch.Tensor, kv_cache: torch.Tensor,
                        meta: SpeedUpperMetadata) -> torch.Tensor:
        k_pages, v_pages = kv_cache_views_split_last_dim(kv_cache)
        if meta.plan is None:
            meta.plan = plan_speed_upper_triton(
                meta.query_positions, meta.query_start_loc, meta.block_table, meta.seq_lens,
                meta.prompt_lens, meta.anchor_tokens, query.device)
        return run_speed_upper_triton(meta.plan, query, k_pages, v_pages, self.scale)


@cache
def speed_backend_on(dense: type[AttentionBackend]) -> type[AttentionBackend]:
    """``ACCEL_SPEED`` built on the dense backend ``dense`` (its Builder and Impl subclassed)."""

    class SpeedCudaMetadataBuilder(SpeedBuilderMixin, dense.get_builder_cls()):
        # read by vLLM through get_cudagraph_support (FlashAttention's and the base's)
        _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    class SpeedCudaImpl(SpeedTritonUpperMixin, dense.get_impl_cls()):
        pass

    class SpeedCudaBackend(CausalDecoderOnly, dense):
        __doc__ = f"SPEED on CUDA: {dense.get_name()} in the lower layers, Triton above."
        supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16"]

        @staticmethod
        def get_name() -> str:
            return NAME

        @staticmethod
        def get_impl_cls():
            return SpeedCudaImpl

        @staticmethod
        def get_builder_cls():
            return SpeedCudaMetadataBuilder

    for cls in (SpeedCudaMetadataBuilder, SpeedCudaImpl, SpeedCudaBackend):
        cls.__qualname__ = f"{cls.__name__}[{dense.get_name()}]"
    return SpeedCudaBackend


def __getattr__(name: str):
    # vLLM resolves ``--attention-backend ACCEL_SPEED`` to this attribute on CUDA; the dense
    # backend is known only once the platform is.
    if name == "SpeedCudaBackend":
        from vllm.platforms import current_platform

        from vllm_accel.attention.base import dense_backend_class

        if not current_platform.is_cuda_alike():
            raise RuntimeError("SpeedCudaBackend is ACCEL_SPEED's CUDA class; on the CPU vLLM "
                               "uses vllm_accel.speed.backend.SpeedBackend")
        return speed_backend_on(dense_backend_class())
    raise AttributeError(name)
