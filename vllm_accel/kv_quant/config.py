"""Knobs of the quantized KV cache (section ``kv_quant`` of ``--additional-config``).

The format itself is chosen with ``--kv-cache-dtype`` (``kivi_4bit`` / ``kivi_2bit``); these knobs
only say how it runs::

    --additional-config '{"vllm_accel": {"kv_quant": {"kernel": "torch"}}}'
    VLLM_ACCEL_KV_QUANT_KERNEL=torch

``residual`` says where the full-precision keys of each sequence's unfinished key group live:

* ``"tail"`` (default): in a pool outside the pages with one entry per running request
  (:mod:`vllm_accel.kv_quant.tail_pool`); pages hold only codes and scales (kivi_4bit at head
  size 64: 72 B per token and KV head against bf16's 256 B, 3.56x; kivi_2bit 40 B, 6.4x). The
  pool (``--max-num-seqs`` slots, allocated by the worker, outside the KV-cache budget) is
  logged at start-up.
* ``"page"``: a residual area in every page (self-contained pages, no per-request state) that
  costs ``2 * key_group * head_size / block_size`` bytes per token and head (64 B at D=64,
  N=128: kivi_4bit 136 B, 1.88x; kivi_2bit 104 B, 2.46x).

``prefill_kv`` says which keys and values a prefill chunk attends to for its own positions
(its context always comes from the quantized cache):

* ``"auto"`` (default): ``exact``, except with the Triton kernel (CUDA's default), which
  reads every row from the pages: ``cache`` there (``exact`` with it is a start-up error until
  the kernel takes the chunk's K/V).
* ``"exact"``: the chunk's own unquantized K/V, as KIVI's reference does in prefill; a prompt
  prefilled in one step is computed as with the unquantized cache and only the tokens after it
  read quantized K/V.
* ``"cache"``: the cache's quantized rows, like every other read (vLLM's own quantized
  caches do this): outputs do not depend on where chunked prefill or a prefix-cache hit split
  the prompt.
Decode rows, and draft-verification rows with ``--speculative-config``, read everything from
the cache in both modes.

``prompt_exact_tokens`` (8192; 0 = off), with ``exact``: how many prompt tokens, over all
requests, keep an unquantized copy between the steps of a prefill that chunked prefill splits,
so a prompt's later steps read its earlier ones unquantized, as one-step prefill would
(:mod:`vllm_accel.kv_quant.prompt_kv`). Held outside vLLM's KV-cache budget, at most
``prompt_exact_tokens * layers * kv_heads * head_size * 2`` elements in the model dtype
(logged at start-up), and only while a prompt is being prefilled.

Four knobs change the page format itself (the bytes per token vLLM budgets follow the first
three; see :mod:`vllm_accel.kernels.kivi_format` for the layout):

* ``key_group`` (64): tokens per key quantization group, one of 16, 32, 64, 128. Smaller groups
  follow the keys more closely and cost ``4 * head_size / key_group`` bytes per token and head in
  scales; the block size must be a multiple of it.
* ``value_group`` (0 = the head size): channels per value quantization group (a multiple of 8
  that divides the head size); 32 at head size 64 costs 4 more bytes per token and head.
* ``sink_tokens`` (0): the first S token slots of every page keep a full-precision copy of their
  K and V (the sequence's first tokens, its attention sinks, on its first page), ``0 <= S <
  key_group`` and ``S <= 32``.
* ``value_rotation`` (``"auto"``): ``"hadamard"`` stores every value row multiplied by the
  head-size Hadamard matrix and rotates the attention output back (same bytes; the head size must
  be a power of two). It spreads a row's large channels over all of them before the per-token
  quantization; see :mod:`vllm_accel.kernels.kivi_format`. ``"auto"``: ``hadamard`` where the
  head size is a power of two, ``none`` (values stored as they are) otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_accel.config import register_section
from vllm_accel.kernels.kivi_format import (
    ALLOWED_KEY_GROUPS,
    MAX_SINK_TOKENS,
    VALUE_ROTATIONS,
    hadamard_fits,
)

if TYPE_CHECKING:
    import torch

SECTION = "kv_quant"
KERNELS = ("auto", "torch", "triton", "native")
RESIDUALS = ("tail", "page")
PREFILL_KV = ("auto", "exact", "cache")
VALUE_ROTATION_KNOB = ("auto", *VALUE_ROTATIONS)


@register_section(SECTION)
@dataclass(frozen=True)
class KvQuantKnobs:
    """``kernel``: implementation of the quantize-on-write and attention kernels (``auto``:
    Triton on CUDA; on CPU the native decode kernel ``vllm_accel._C_kivi`` when it is built,
    torch otherwise; ``native``: that kernel or a start-up error; ``triton`` on CPU needs
    ``TRITON_INTERPRET=1``).
    ``residual``: where the unfinished key group is kept (``tail``: a per-request pool;
    ``page``: every page; see the module doc).
    ``prefill_kv``: what a prefill chunk attends to for its own positions (``exact``: its
    unquantized K/V; ``cache``: the quantized cache; ``auto``: cache with the Triton kernel,
    exact otherwise;
    see the module doc).
    ``prompt_exact_tokens``: prompt tokens (all requests) kept unquantized between prefill
    steps for the prompt's later steps to read (``exact`` only; 0: off).
    ``key_group``, ``value_group`` (0: the head size), ``sink_tokens``, ``value_rotation``: the
    page format's key group (tokens), value group (channels), full-precision sink slots per page
    and value rotation (``auto``, ``none`` or ``hadamard``)."""

    kernel: str = "auto"
    residual: str = "tail"
    prefill_kv: str = "auto"
    prompt_exact_tokens: int = 8192
    key_group: int = 64
    value_group: int = 0
    sink_tokens: int = 0
    value_rotation: str = "auto"

    def validate(self) -> dict[str, str]:
        problems: dict[str, str] = {}
        if self.kernel not in KERNELS:
            problems["kernel"] = f"must be one of {', '.join(KERNELS)}"
        if self.residual not in RESIDUALS:
            problems["residual"] = f"must be one of {', '.join(RESIDUALS)}"
        if self.prefill_kv not in PREFILL_KV:
            problems["prefill_kv"] = f"must be one of {', '.join(PREFILL_KV)}"
        if self.prompt_exact_tokens < 0:
            problems["prompt_exact_tokens"] = "must be >= 0 (0 turns the buffer off)"
        if self.key_group not in ALLOWED_KEY_GROUPS:
            problems["key_group"] = f"must be one of {', '.join(map(str, ALLOWED_KEY_GROUPS))}"
        if self.value_group < 0 or self.value_group % 8 != 0:
            problems["value_group"] = ("must be 0 (the head size) or a positive multiple of 8 "
                                       "that divides the head size")
        if not 0 <= self.sink_tokens < min(self.key_group, MAX_SINK_TOKENS + 1):
            problems["sink_tokens"] = (f"must be in [0, {min(self.key_group - 1, MAX_SINK_TOKENS)}]"
                                       f" (below key_group={self.key_group}, at most "
                                       f"{MAX_SINK_TOKENS})")
        if self.value_rotation not in VALUE_ROTATION_KNOB:
            problems["value_rotation"] = f"must be one of {', '.join(VALUE_ROTATION_KNOB)}"
        return problems


def load_knobs(additional_config: dict | None) -> KvQuantKnobs:
    from vllm_accel.config import load_section

    return load_section(SECTION, additional_config)


def resolve_value_rotation(value_rotation: str, head_size: int) -> str:
    """``auto`` -> ``hadamard`` where ``head_size`` is a power of two (the size the Sylvester
    Hadamard matrix exists at), ``none`` otherwise; other values as given.

    >>> resolve_value_rotation("auto", 64), resolve_value_rotation("auto", 96)
    ('hadamard', 'none')
    """
    if value_rotation == "auto":
        return "hadamard" if hadamard_fits(head_size) else "none"
    return value_rotation


def resolve_prefill_kv(prefill_kv: str, kernel: str) -> str:
    """``auto`` -> ``cache`` for the Triton kernel (it reads every row from the pages),
    ``exact`` for the CPU kernels and torch; other values as given."""
    if prefill_kv == "auto":
        return "cache" if kernel == "triton" else "exact"
    return prefill_kv


def exact_prefill(knobs: KvQuantKnobs, device: torch.device) -> bool:
    """Whether prefill chunks attend to their own unquantized K/V (``prefill_kv`` resolved
    for the kernel ``kernel: auto`` picks on ``device``)."""
    from vllm_accel.kernels.kivi_cache import resolve_backend

    kernel = resolve_backend("auto", device) if knobs.kernel == "auto" else knobs.kernel
    return resolve_prefill_kv(knobs.prefill_kv, kernel) == "exact"
