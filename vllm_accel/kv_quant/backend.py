"""``ACCEL_KIVI_4BIT`` / ``ACCEL_KIVI_2BIT``: attention over a KIVI-quantized paged KV cache.

Selected automatically by ``--kv-cache-dtype kivi_4bit`` / ``kivi_2bit``, on vLLM's CPU and CUDA
platforms (one backend for both: it owns its page format and its kernels, nothing of vLLM's dense
backends). Roles:

* **Backend** -- owns the page format. :meth:`KiviBackend.customize_spec` sets vLLM's
  ``state_content_bytes`` to ``KiviLayout.bytes_per_token_head``, so block accounting, memory
  profiling and the "KV cache size: N tokens" line count the real bytes of a quantized page.
  Pages are ``uint8 [num_blocks, H_kv, block_size, C]`` (layout LBHNC, one contiguous page per
  block and KV head, what :class:`~vllm_accel.kernels.kivi_format.KiviLayout` expects).
* **Builder** -- passes vLLM's varlen metadata through (no scheduler metadata, no C++ op: the
  CPU backend's builder would hand the unknown dtype name to ``cpu_attn_get_scheduler_metadata``),
  gives every row its residual-pool entries and, with exact prefill, plans the step's reads and
  writes of the exact prompt buffer (:mod:`vllm_accel.kv_quant.prompt_kv`: a prompt's earlier
  prefill steps, unquantized, for its later steps).
* **Impl** -- ``do_kv_cache_update`` quantizes on write
  (:func:`~vllm_accel.kernels.kivi_cache.quantize_on_write`); ``forward`` runs
  :func:`~vllm_accel.kernels.kivi_attention.kivi_paged_attention` (on CPU: decode rows through the
  native kernel ``vllm_accel._C_kivi`` when built, other rows through the torch path; on CUDA:
  the Triton write and fused attention kernels, which read the packed pages directly).

CUDA graphs: the builder keeps vLLM's default ``NEVER`` (the residual-pool entries are assigned on
the host each step), so vLLM captures at most the layers between attention ops (piecewise); the
cache write and attention run eagerly.

Residual placement (knob ``residual``, :mod:`vllm_accel.kv_quant.config`): with ``"tail"`` (the
default) the keys of each running request's unfinished 64-token key group live in a
:class:`~vllm_accel.kv_quant.tail_pool.TailPool` owned by the builder, one slot per request
(request ids from :mod:`vllm_accel.attention.step_requests`, runtime patch
``attention_step_requests``); pages hold codes and scales only (kivi_4bit 72 B per token and KV
head at head size 64, 3.56x the tokens of bf16; kivi_2bit 40 B, 6.4x). With ``"page"`` every
page carries the residual area instead (self-contained, 136 B / 104 B: 1.88x / 2.46x).

Start-up checks (:func:`startup_problems`) name the flag and the supported values: CPU or CUDA
platform (CUDA: the Triton kernels, or ``kernel: torch``), ``--dtype`` bfloat16/float16/float32,
``--block-size`` a multiple of the 64-token key group, head size a multiple of 8 (>= 16),
decoder self-attention without sliding window, ALiBi, soft-capping or sinks.
"""

from __future__ import annotations

from collections.abc import Callable
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

from vllm_accel.attention import step_requests
from vllm_accel.attention.registry import KV_CACHE_DTYPE_BACKENDS
from vllm_accel.kernels.kivi_attention import kivi_paged_attention
from vllm_accel.kernels.kivi_cache import quantize_on_write, resolve_backend
from vllm_accel.kernels.kivi_format import (
    ALLOWED_DTYPES,
    KiviLayout,
    hadamard_fits,
    hadamard_matrix,
)
from vllm_accel.kv_quant.config import (
    KvQuantKnobs,
    exact_prefill,
    load_knobs,
    resolve_prefill_kv,
    resolve_value_rotation,
)
from vllm_accel.kv_quant.prompt_kv import PromptKvBuffer, PromptKvStep, buffer_bytes
from vllm_accel.kv_quant.tail_pool import TailPool, entries_per_request
from vllm_accel.log import get_logger

logger = get_logger("kv_quant")

# the residual keys are stored in the model dtype: the dtypes the page format takes
SUPPORTED_MODEL_DTYPES = ALLOWED_DTYPES
SUPPORTED_MODEL_DTYPE_NAMES = ", ".join(str(d).replace("torch.", "") for d in ALLOWED_DTYPES)
DEFAULT_CPU_BLOCK_SIZE = 128  # vLLM's CPU default when --block-size is not given
_LOGGED_LAYOUTS: set[KiviLayout] = set()
_LOGGED_KERNELS: set[tuple[str, bool]] = set()
# knobs and model dtype of the layers built in this process: vLLM asks customize_spec for the
# page bytes in the worker outside any vLLM config context, after the model's layers were built
_BUILT_FORMAT: dict[str, tuple[KvQuantKnobs, torch.dtype]] = {}


def page_format() -> tuple[KvQuantKnobs, torch.dtype]:
    """The ``kv_quant`` knobs and model dtype of the vLLM config being built or run, else of the
    layers built in this process, else of the environment and bf16. The page format follows the
    knobs ``residual``, ``key_group``, ``value_group``, ``sink_tokens``, ``value_rotation`` and,
    through the sink rows, the model dtype."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None:
        model = getattr(config, "model_config", None)
        return load_knobs(config.additional_config), getattr(model, "dtype", torch.bfloat16)
    built = _BUILT_FORMAT.get("format")
    return built if built is not None else (load_knobs(None), torch.bfloat16)


def page_layout(kv_cache_dtype: str, head_size: int, block_size: int,
                dtype: torch.dtype = torch.bfloat16,
                knobs: KvQuantKnobs | None = None) -> KiviLayout:
    """The page format of ``--kv-cache-dtype kv_cache_dtype`` for one layer geometry (``knobs``:
    the format knobs; None = their defaults)."""
    knobs = knobs if knobs is not None else KvQuantKnobs()
    return KiviLayout.preset(kv_cache_dtype, head_size=head_size, block_size=block_size,
                             dtype=dtype, residual=knobs.residual, key_group=knobs.key_group,
                             value_group=knobs.value_group or None,
                             sink_tokens=knobs.sink_tokens,
                             value_rotation=resolve_value_rotation(knobs.value_rotation, head_size))


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
    cache_config = config.cache_config
    if not getattr(cache_config, "user_specified_block_size", True):
        # vLLM's default; it aligns the block size to get_supported_kernel_block_sizes later
        # (CUDA: 16 -> 64; the CPU platform's 128 already fits)
        return None
    return cache_config.block_size


def startup_problems(kv_cache_dtype: str, selector_config: Any) -> list[str]:
    """Why ``--kv-cache-dtype kv_cache_dtype`` cannot run this layer (empty when it can)."""
    from vllm.platforms import current_platform

    flag = f"--kv-cache-dtype {kv_cache_dtype}"
    problems = platform_problems(flag, current_platform)
    if selector_config.dtype not in SUPPORTED_MODEL_DTYPES:
        problems.append(
            f"{flag} cannot store the residual keys of --dtype "
            f"{str(selector_config.dtype).replace('torch.', '')}; supported: "
            f"{SUPPORTED_MODEL_DTYPE_NAMES}")
    knobs, _ = page_format()
    group = knobs.key_group
    block = _current_block_size(selector_config.block_size)
    if block is not None and block % group != 0:
        problems.append(
            f"--block-size {block} is not supported with {flag}: the block must hold whole "
            f"{group}-token key groups (vllm_accel.kv_quant.key_group={group}); supported: "
            f"multiples of {group} ({', '.join(str(group * m) for m in (1, 2, 4))}, ...; the CPU "
            f"default is 128)")
    head = selector_config.head_size
    if head < 16 or head % 8 != 0:
        problems.append(
            f"{flag} cannot store this model: head size {head} is not supported; supported: "
            f"multiples of 8 from 16")
    elif knobs.value_group and head % knobs.value_group != 0:
        fits = ", ".join(str(g) for g in range(8, head + 1, 8) if head % g == 0)
        problems.append(
            f"{flag} with vllm_accel.kv_quant.value_group={knobs.value_group}: the value group "
            f"must divide this model's head size {head}; supported: 0 (the head size), {fits}")
    if knobs.value_rotation == "hadamard" and not hadamard_fits(head):
        problems.append(
            f"{flag} with vllm_accel.kv_quant.value_rotation='hadamard' needs a power-of-two head "
            f"size; this model's is {head}; supported here: 'none' or 'auto' (which resolves to "
            f"'none' at this head size)")
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


def platform_problems(flag: str, platform: Any) -> list[str]:
    """Why this platform cannot run the KIVI kernels the ``kv_quant.kernel`` knob asks for."""
    if platform.is_cpu():
        return []
    if not platform.is_cuda():
        return [f"{flag} runs on vLLM's CPU and CUDA platforms; this is "
                f"{type(platform).__name__}: use --kv-cache-dtype auto or fp8 here"]
    from vllm.config import get_current_vllm_config_or_none

    from vllm_accel.kernels.kivi_cache import HAS_TRITON

    config = get_current_vllm_config_or_none()
    knobs = load_knobs(config.additional_config if config is not None else None)
    kernel = knobs.kernel
    knob = f"vllm_accel.kv_quant.kernel={kernel!r}"
    if kernel == "native":
        return [f"{flag} with {knob}: the native kernels are CPU kernels; supported on CUDA: "
                f"auto, triton, torch"]
    problems = []
    if kernel in ("auto", "triton") and not HAS_TRITON:
        problems.append(f"{flag} with {knob} needs Triton on CUDA and it does not import; "
                        f"install triton, or set the knob to torch (dequantize + SDPA, slow)")
    if knobs.prefill_kv == "exact" and kernel in ("auto", "triton"):
        problems.append(f"{flag} with vllm_accel.kv_quant.prefill_kv='exact' and {knob}: the "
                        f"Triton kernel does not take the chunk's own K/V yet; supported with "
                        f"it: auto, cache (or set the kernel knob to torch)")
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
        return [MultipleOf(page_format()[0].key_group)]

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
        knobs, model_dtype = page_format()
        block = spec.block_size
        if block % knobs.key_group != 0:
            block = DEFAULT_CPU_BLOCK_SIZE
        layout = page_layout(cls.KV_CACHE_DTYPE, spec.head_size, block, model_dtype, knobs)
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
    # residual="tail" only: the pool, the entry of each written key and of each row's
    # unfinished key group
    tail_pool: TailPool | None = None
    tail_mapping: torch.Tensor | None = None
    tail_index: torch.Tensor | None = None
    # prompt_exact_tokens > 0 with exact prefill: the step's reads and writes of the buffer of
    # unquantized prompt K/V (None when no row reads or keeps any)
    prompt_kv: PromptKvStep | None = None


# per engine (vllm_config), KV-cache group (its layers) and kind: state its builders share
_ENGINE_STATE: dict[tuple[str, int, tuple[str, ...]], Any] = {}


def _engine_state(kind: str, vllm_config: Any, layer_names: list[str],
                  make: Callable[[], Any]) -> Any:
    """The ``kind`` object of this engine's KV-cache group, made on first use; an earlier
    engine's objects (same process, e.g. one test after another) are dropped."""
    key = (kind, id(vllm_config), tuple(layer_names))
    state = _ENGINE_STATE.get(key)
    if state is None:
        for stale in [k for k in _ENGINE_STATE if k[1] != id(vllm_config)]:
            del _ENGINE_STATE[stale]
        state = _ENGINE_STATE[key] = make()
    return state


def tail_pool_for(kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any,
                  device: torch.device, key_group: int) -> TailPool:
    """The residual pool of one KV-cache group of one engine (shared by its builders)."""
    def make() -> TailPool:
        pool = TailPool(
            layer_names, num_kv_heads=kv_cache_spec.num_kv_heads,
            key_group=key_group, head_size=kv_cache_spec.head_size,
            dtype=vllm_config.model_config.dtype, device=device,
            max_requests=vllm_config.scheduler_config.max_num_seqs,
            entries_per_slot=entries_per_request(vllm_config.speculative_config is not None))
        logger.info("KIVI residual pool: %s", pool.describe())
        return pool

    return _engine_state("tail_pool", vllm_config, layer_names, make)


def prompt_buffer_for(kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any,
                      capacity_tokens: int) -> PromptKvBuffer:
    """The exact-prompt buffer of one KV-cache group of one engine (shared by its builders)."""
    def make() -> PromptKvBuffer:
        most = buffer_bytes(capacity_tokens=capacity_tokens, num_layers=len(layer_names),
                            num_kv_heads=kv_cache_spec.num_kv_heads,
                            head_size=kv_cache_spec.head_size,
                            dtype_bytes=vllm_config.model_config.dtype.itemsize)
        logger.info("KIVI exact prompt buffer: up to %d prompt tokens (%.1f MiB) stay "
                    "unquantized between the prefill steps of a prompt, outside the KV-cache "
                    "budget (vllm_accel.kv_quant.prompt_exact_tokens; 0 turns it off)",
                    capacity_tokens, most / 2**20)
        return PromptKvBuffer(capacity_tokens)

    return _engine_state("prompt_kv", vllm_config, layer_names, make)


def prefill_min_rows(vllm_config: Any) -> int:
    """The fewest rows a step of a sequence has to be a prefill chunk: a decode row is one,
    a draft verification ``1 + k``."""
    spec = vllm_config.speculative_config if vllm_config is not None else None
    return 2 + (spec.num_speculative_tokens if spec is not None else 0)


class KiviMetadataBuilder(AttentionMetadataBuilder[KiviAttentionMetadata]):
    """vLLM's varlen metadata, as the KIVI kernels take it (mixed prefill/decode batches), plus
    each row's residual-pool entries (``residual="tail"``)."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.kv_cache_spec = kv_cache_spec
        self.tail_pool: TailPool | None = None
        self.prompt_buffer: PromptKvBuffer | None = None
        self.prefill_min_rows = prefill_min_rows(vllm_config)
        knobs = load_knobs(vllm_config.additional_config)
        if knobs.residual == "tail":
            self.tail_pool = tail_pool_for(kv_cache_spec, layer_names, vllm_config, device,
                                           knobs.key_group)
        if knobs.prompt_exact_tokens and exact_prefill(knobs, device):
            self.prompt_buffer = prompt_buffer_for(kv_cache_spec, layer_names, vllm_config,
                                                   knobs.prompt_exact_tokens)
        if self.tail_pool is not None or self.prompt_buffer is not None:
            from vllm_accel._patches import attention_step_requests

            attention_step_requests.enable()

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KiviAttentionMetadata:
        cm = common_attn_metadata
        if cm.causal is not True:
            raise ValueError("KIVI attention supports causal decoder attention only")
        tail_mapping = tail_index = prompt_kv = None
        if self.tail_pool is not None or self.prompt_buffer is not None:
            row_req_ids = step_requests.row_req_ids(cm.num_reqs)
            live_req_ids = step_requests.live_req_ids()
        if self.tail_pool is not None:
            tail_mapping, tail_index = self.tail_pool.step(
                row_req_ids, live_req_ids,
                cm.query_start_loc, cm.seq_lens, int(cm.query_start_loc_cpu[-1]),
                padded_tokens=max(cm.num_actual_tokens, cm.slot_mapping.shape[0]))
        if self.prompt_buffer is not None:
            prompt_kv = self.prompt_buffer.plan(
                row_req_ids, live_req_ids,
                cm.query_start_loc_cpu.tolist(), cm.seq_lens.cpu().tolist(),
                step_requests.prompt_lens(cm.num_reqs).tolist(), self.prefill_min_rows)
        return KiviAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            tail_pool=self.tail_pool,
            tail_mapping=tail_mapping,
            tail_index=tail_index,
            prompt_kv=prompt_kv,
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
            raise ValueError(f"{flag} needs --dtype {SUPPORTED_MODEL_DTYPE_NAMES}; got "
                             f"{model_dtype}")
        self.kv_cache_dtype = kv_cache_dtype
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.model_dtype = model_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.knobs: KvQuantKnobs = load_knobs(additional)
        device = torch.device(config.device_config.device if config is not None else "cpu")
        _BUILT_FORMAT["format"] = (self.knobs, model_dtype)
        probe = page_layout(kv_cache_dtype, head_size, max(128, self.knobs.key_group),
                            model_dtype, self.knobs)
        try:
            self.kernel = resolve_backend(self.knobs.kernel, device, probe)
        except RuntimeError as exc:
            here = "auto, triton, torch" if device.type == "cuda" else "auto, torch, native"
            raise ValueError(f"{flag}: vllm_accel.kv_quant.kernel={self.knobs.kernel!r}: {exc}; "
                             f"supported on {device.type}: {here}") from exc
        # prefill chunks attend to their own unquantized K/V ("exact"); decode rows, and the
        # 1 + k rows of a draft verification, read everything from the cache
        prefill_kv = resolve_prefill_kv(self.knobs.prefill_kv, self.kernel)
        if prefill_kv == "exact" and self.kernel == "triton":
            raise ValueError(f"{flag}: vllm_accel.kv_quant.prefill_kv='exact' is not supported "
                             f"by the Triton kernel yet; supported with it: auto, cache (or "
                             f"set vllm_accel.kv_quant.kernel to torch)")
        self.exact_prefill = prefill_kv == "exact"
        self.prefill_min_rows = prefill_min_rows(config)
        if (self.kernel, self.exact_prefill) not in _LOGGED_KERNELS:
            _LOGGED_KERNELS.add((self.kernel, self.exact_prefill))
            why = ""
            if self.knobs.kernel == "auto" and self.kernel == "torch" and device.type == "cpu":
                from vllm_accel.kernels.kivi_cpu import native_problem

                why = f"; not native: {native_problem(probe, device)}"
            logger.info("%s: cache write and attention kernel %s (knob "
                        "vllm_accel.kv_quant.kernel=%s%s); prefill chunks attend to their own "
                        "K/V %s (vllm_accel.kv_quant.prefill_kv=%s); values stored %s "
                        "(vllm_accel.kv_quant.value_rotation=%s)", flag, self.kernel,
                        self.knobs.kernel, why,
                        "unquantized" if self.exact_prefill else "from the quantized cache",
                        self.knobs.prefill_kv,
                        "Hadamard-rotated" if probe.value_rotation == "hadamard" else "as they are",
                        self.knobs.value_rotation)
        self._layouts: dict[int, KiviLayout] = {}
        if probe.value_rotation == "hadamard":  # built once here, not inside a forward
            hadamard_matrix(head_size, torch.empty(0, device=device).device)  # "cuda" -> cuda:N

    def layout_for(self, kv_cache: torch.Tensor) -> KiviLayout:
        """The page layout of this layer's cache ``[num_blocks, H_kv, block_size, C]``."""
        block = kv_cache.shape[2]
        layout = self._layouts.get(block)
        if layout is None:
            layout = page_layout(self.kv_cache_dtype, self.head_size, block, self.model_dtype,
                                 self.knobs)
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
        metadata = None
        if self.knobs.residual == "tail":
            from vllm.model_executor.layers.attention.attention import get_attention_context

            metadata = get_attention_context(layer.layer_name)[0]
        self.write(layer, key, value, kv_cache, slot_mapping, metadata)

    def write(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
              kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              metadata: KiviAttentionMetadata | None) -> None:
        """Quantize this step's keys and values into the cache (residual keys into the pool)."""
        layout = self.layout_for(kv_cache)
        n = slot_mapping.shape[0]
        k_tail = tail_mapping = None
        if layout.residual == "tail":
            if metadata is None:  # profiling / warm-up run: nothing will read these slots
                return
            k_tail = metadata.tail_pool.layer(layer.layer_name)
            tail_mapping = metadata.tail_mapping[:n]
        quantize_on_write(key[:n], value[:n], kv_cache, slot_mapping, layout,
                          k_tail=k_tail, tail_mapping=tail_mapping, backend=self.kernel)

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
        layout = self.layout_for(kv_cache)
        k_tail = None
        if layout.residual == "tail":
            k_tail = attn_metadata.tail_pool.layer(layer.layer_name)
        prompt_kv = attn_metadata.prompt_kv if self.exact_prefill else None
        kivi_paged_attention(
            query[:n], kv_cache, attn_metadata.block_table, attn_metadata.seq_lens,
            attn_metadata.query_start_loc, self.scale, layout,
            out=output[:n], max_query_len=attn_metadata.max_query_len,
            max_seq_len=attn_metadata.max_seq_len, backend=self.kernel,
            k_tail=k_tail, tail_index=attn_metadata.tail_index,
            chunk_kv=(key[:n], value[:n]) if self.exact_prefill else None,
            chunk_kv_min_rows=self.prefill_min_rows,
            context_kv=prompt_kv.context(layer.layer_name) if prompt_kv is not None else None,
        )
        if prompt_kv is not None:
            prompt_kv.store(layer.layer_name, key[:n], value[:n])
        return output
