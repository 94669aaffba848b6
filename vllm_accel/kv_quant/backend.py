"""``ACCEL_KIVI_4BIT`` / ``ACCEL_KIVI_2BIT``: attention over a KIVI-quantized paged KV cache.

Selected automatically by ``--kv-cache-dtype kivi_4bit`` / ``kivi_2bit`` (CPU platform). Roles:

* **Backend** -- owns the page format. :meth:`KiviBackend.customize_spec` sets vLLM's
  ``state_content_bytes`` to ``KiviLayout.bytes_per_token_head``, so block accounting, memory
  profiling and the "KV cache size: N tokens" line count the real bytes of a quantized page.
  Pages are ``uint8 [num_blocks, H_kv, block_size, C]`` (layout LBHNC, one contiguous page per
  block and KV head, what :class:`~vllm_accel.kernels.kivi_format.KiviLayout` expects).
* **Builder** -- passes vLLM's varlen metadata through (no scheduler metadata, no C++ op: the
  CPU backend's builder would hand the unknown dtype name to ``cpu_attn_get_scheduler_metadata``).
* **Impl** -- ``do_kv_cache_update`` quantizes on write
  (:func:`~vllm_accel.kernels.kivi_cache.quantize_on_write`); ``forward`` runs
  :func:`~vllm_accel.kernels.kivi_attention.kivi_paged_attention` (torch path on CPU).

Residual placement: ``residual="page"`` (see :mod:`vllm_accel.kv_quant.config`): the keys of a
sequence's unfinished 64-token key group stay in bf16 in a residual area of the page itself. Pages
are self-contained (prefix caching, preemption and request churn need no extra state); the cost is
that area: 136 B per token and KV head for kivi_4bit at head size 64 and block 128 (1.88x the
tokens of bf16), 104 B for kivi_2bit (2.46x); larger ``--block-size`` amortises it (256: 2.46x /
3.56x).

Start-up checks (:func:`startup_problems`) name the flag and the supported values: CPU platform
only, ``--dtype`` bfloat16/float16, ``--block-size`` a multiple of the 64-token key group, head
size a multiple of 8 (>= 16), decoder self-attention without sliding window, ALiBi, soft-capping
or sinks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from vllm_accel.attention.registry import KV_CACHE_DTYPE_BACKENDS
from vllm_accel.kernels.kivi_attention import kivi_paged_attention
from vllm_accel.kernels.kivi_cache import quantize_on_write
from vllm_accel.kernels.kivi_format import PRESETS, KiviLayout
from vllm_accel.kv_quant.config import KvQuantKnobs, load_knobs
from vllm_accel.log import get_logger

logger = get_logger("kv_quant")

RESIDUAL = "page"
SUPPORTED_MODEL_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT_CPU_BLOCK_SIZE = 128  # vLLM's CPU default when --block-size is not given
_LOGGED_LAYOUTS: set[KiviLayout] = set()


def key_group(kv_cache_dtype: str) -> int:
    return PRESETS[kv_cache_dtype]["key_group"]


def page_layout(kv_cache_dtype: str, head_size: int, block_size: int,
                dtype: torch.dtype = torch.bfloat16) -> KiviLayout:
    """The page format of ``--kv-cache-dtype kv_cache_dtype`` for one layer geometry."""
    return KiviLayout.preset(kv_cache_dtype, head_size=head_size, block_size=block_size,
                             dtype=dtype, residual=RESIDUAL)


# --------------------------------------------------------------------------------------------
# Start-up validation (called by the kv_cache_dtype_backend patch before selection)
# --------------------------------------------------------------------------------------------
def _current_block_size(selector_block_size: int | None) -> int | None:
    if selector_block_size is not None:
        return selector_block_size
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or config.cache_config is None:
        return None
    return config.cache_config.block_size


def startup_problems(kv_cache_dtype: str, selector_config: Any) -> list[str]:
    """Why ``--kv-cache-dtype kv_cache_dtype`` cannot run this layer (empty when it can)."""
    from vllm.platforms import current_platform

    flag = f"--kv-cache-dtype {kv_cache_dtype}"
    problems = []
    if not current_platform.is_cpu():
        problems.append(
            f"{flag} is wired for the CPU platform only in this vllm_accel release (this is "
            f"{type(current_platform).__name__}); use --kv-cache-dtype auto or fp8 on GPUs")
    if selector_config.dtype not in SUPPORTED_MODEL_DTYPES:
        problems.append(
            f"{flag} needs a 16-bit model dtype; got --dtype "
            f"{str(selector_config.dtype).replace('torch.', '')}; supported: bfloat16, float16")
    group = key_group(kv_cache_dtype)
    block = _current_block_size(selector_config.block_size)
    if block is not None and block % group != 0:
        problems.append(
            f"--block-size {block} is not supported with {flag}: the block must hold whole "
            f"{group}-token key groups; supported: multiples of {group} (64, 128 (CPU default), "
            f"256, ...)")
    head = selector_config.head_size
    if head < 16 or head % 8 != 0:
        problems.append(
            f"{flag} cannot store this model: head size {head} is not supported; supported: "
            f"multiples of 8 from 16")
    if selector_config.use_mla:
        problems.append(f"{flag} does not support MLA models")
    if selector_config.attn_type != AttentionType.DECODER:
        problems.append(
            f"{flag} supports decoder self-attention only; got {selector_config.attn_type}")
    if selector_config.has_sliding_window:
        problems.append(f"{flag} does not support sliding-window attention layers")
    if selector_config.has_sink:
        problems.append(f"{flag} does not support attention sinks")
    return problems


def raise_startup_problems(kv_cache_dtype: str, selector_config: Any) -> None:
    problems = startup_problems(kv_cache_dtype, selector_config)
    if problems:
        raise ValueError("; ".join(problems))


# --------------------------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------------------------
class KiviBackend(AttentionBackend):
    """Base of the KIVI backends; subclasses fix :attr:`KV_CACHE_DTYPE`."""

    KV_CACHE_DTYPE: ClassVar[str]
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = list(SUPPORTED_MODEL_DTYPES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(key_group(cls.KV_CACHE_DTYPE))]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size >= 16 and head_size % 8 == 0

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Page bytes of the quantized format: ``state_content_bytes = bytes_per_token_head``.

        vLLM also asks for the per-token page of a ``block_size=1`` spec when it aligns hybrid
        models' pages; the bytes per token are then those of the CPU default block.
        """
        if spec.dtype != torch.uint8:
            raise ValueError(
                f"--kv-cache-dtype {cls.KV_CACHE_DTYPE}: the KV cache spec's dtype is "
                f"{spec.dtype}, expected torch.uint8 (is the kv_cache_torch_dtype patch active?)")
        block = spec.block_size
        if block % key_group(cls.KV_CACHE_DTYPE) != 0:
            block = DEFAULT_CPU_BLOCK_SIZE
        layout = page_layout(cls.KV_CACHE_DTYPE, spec.head_size, block)
        return replace(spec, state_content_bytes=layout.bytes_per_token_head)

    @staticmethod
    def get_impl_cls() -> type[KiviAttentionImpl]:
        return KiviAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KiviMetadataBuilder]:
        return KiviMetadataBuilder


class Kivi4BitBackend(KiviBackend):
    KV_CACHE_DTYPE = "kivi_4bit"
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["kivi_4bit"]

    @staticmethod
    def get_name() -> str:
        return KV_CACHE_DTYPE_BACKENDS["kivi_4bit"]


class Kivi2BitBackend(KiviBackend):
    KV_CACHE_DTYPE = "kivi_2bit"
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["kivi_2bit"]

    @staticmethod
    def get_name() -> str:
        return KV_CACHE_DTYPE_BACKENDS["kivi_2bit"]


# --------------------------------------------------------------------------------------------
# Metadata builder
# --------------------------------------------------------------------------------------------
@dataclass
class KiviAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class KiviMetadataBuilder(AttentionMetadataBuilder[KiviAttentionMetadata]):
    """vLLM's varlen metadata, as the KIVI kernels take it (mixed prefill/decode batches)."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.kv_cache_spec = kv_cache_spec

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KiviAttentionMetadata:
        cm = common_attn_metadata
        if cm.causal is not True:
            raise ValueError("KIVI attention supports causal decoder attention only")
        return KiviAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
        )


# --------------------------------------------------------------------------------------------
# Impl
# --------------------------------------------------------------------------------------------
class KiviAttentionImpl(AttentionImpl):
    """Quantize on write, attend over the quantized pages."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **extra: Any) -> None:
        flag = f"--kv-cache-dtype {kv_cache_dtype}"
        if kv_cache_dtype not in KV_CACHE_DTYPE_BACKENDS:
            raise ValueError(
                f"KIVI attention got --kv-cache-dtype {kv_cache_dtype}; supported: "
                f"{', '.join(KV_CACHE_DTYPE_BACKENDS)}")
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            "sliding window": sliding_window is not None,
            "logits soft-capping": bool(logits_soft_cap),
            "attention sinks": extra.get("sinks") is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        bad = [name for name, present in unsupported.items() if present]
        if bad:
            raise ValueError(f"{flag} does not support {', '.join(bad)} (this model uses it)")
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"{flag}: {num_heads} query heads are not a multiple of "
                             f"{num_kv_heads} KV heads")
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        model_dtype = config.model_config.dtype if config is not None else torch.bfloat16
        additional = config.additional_config if config is not None else None
        if model_dtype not in SUPPORTED_MODEL_DTYPES:
            raise ValueError(f"{flag} needs --dtype bfloat16 or float16; got {model_dtype}")
        self.kv_cache_dtype = kv_cache_dtype
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.model_dtype = model_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.knobs: KvQuantKnobs = load_knobs(additional)
        self._layouts: dict[int, KiviLayout] = {}

    def layout_for(self, kv_cache: torch.Tensor) -> KiviLayout:
        """The page layout of this layer's cache ``[num_blocks, H_kv, block_size, C]``."""
        block = kv_cache.shape[2]
        layout = self._layouts.get(block)
        if layout is None:
            layout = page_layout(self.kv_cache_dtype, self.head_size, block, self.model_dtype)
            if kv_cache.shape[3] != layout.bytes_per_token_head:
                raise RuntimeError(
                    f"--kv-cache-dtype {self.kv_cache_dtype}: the KV cache has "
                    f"{kv_cache.shape[3]} bytes per token and head, the page format needs "
                    f"{layout.bytes_per_token_head} ({layout.describe()})")
            self._layouts[block] = layout
            if layout not in _LOGGED_LAYOUTS:
                _LOGGED_LAYOUTS.add(layout)
                logger.info("KIVI page format: %s", layout.describe())
        return layout

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        n = slot_mapping.shape[0]
        quantize_on_write(key[:n], value[:n], kv_cache, slot_mapping, self.layout_for(kv_cache),
                          backend=self.knobs.kernel)

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KiviAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("KIVI attention does not support fused output quantization")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        n = attn_metadata.num_actual_tokens
        kivi_paged_attention(
            query[:n], kv_cache, attn_metadata.block_table, attn_metadata.seq_lens,
            attn_metadata.query_start_loc, self.scale, self.layout_for(kv_cache),
            out=output[:n], max_query_len=attn_metadata.max_query_len,
            max_seq_len=attn_metadata.max_seq_len, backend=self.knobs.kernel,
        )
        return output
