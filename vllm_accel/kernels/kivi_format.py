"""KIVI-style 2/4-bit KV-cache format for vLLM's paged cache: page layout, packing, fake quant.

What is quantized how
---------------------
* **Keys per channel.**  A *key group* is ``key_group`` consecutive token slots of one page and one
  KV head.  Each channel (head dimension ``d``) of the group gets its own asymmetric scale/zero
  (``x ~= code * scale + zero``), so an outlier channel only widens its own range.  A group must
  lie inside one page (``block_size % key_group == 0``) and is quantized only once it is full.
* **Values per token.**  Each (token, head) row is split into ``value_group``-wide channel groups
  with their own scale/zero.  Values are quantized as soon as they are written.
* **Residual ("tail").**  The keys of the group that is still filling up stay in full precision
  (``dtype``, normally bf16) in a *tail entry* ``[key_group, head_size]`` per KV head, and are read
  from there by attention.  When the token that completes the group is written, the whole group is
  quantized from the tail (plus the group's tokens written in the same call) into the page.
* **Sinks.**  With ``sink_tokens = S > 0`` the first ``S`` token slots of every page keep a
  full-precision copy of their key and value; attention reads those rows from the copy and they
  are left out of the key group's min/max.  For a sequence's first page these are the attention
  sink tokens; for later pages the area exists anyway (every page has the same size), so those rows
  get the extra precision for free.
* **Value rotation** (optional, ``value_rotation="hadamard"``).  Each value row is multiplied by
  the normalized Hadamard matrix ``H`` of size D (symmetric, orthogonal, its own inverse) before it
  is quantized, so the page holds ``quant(v @ H)``; attention computes ``sum_t p_t (v_t @ H)`` over
  the rotated rows and multiplies the output by ``H`` once (:func:`rotate_values`).  The rotation
  spreads a row's large channels over all channels, so its per-token range is set by the row's
  norm rather than its largest channel (as vLLM's ``int4_per_token_head`` does for keys and
  values); keys are left alone (their per-channel groups already isolate outlier channels, and a
  rotation would mix those into every channel).  D must be a power of two.
* **Scales and zero points** are float16 (clamped to +-65504), ``code`` is unsigned
  ``bits``-wide; codes are packed along the head dimension, lowest channel in the lowest bits:
  byte ``j`` of a row holds channels ``P*j .. P*j+P-1`` with ``P = 8 // bits``.

Rounding (identical in the torch reference and the Triton kernels, so both write the same bytes)::

    lo, hi = min(x), max(x) over the group (fp32)
    scale  = fp16((hi - lo) / (2**bits - 1));  zero = fp16(lo)
    code   = clamp(floor((x - zero) / (scale if scale > 0 else 1) + 0.5), 0, 2**bits - 1)
    x_hat  = code * scale + zero          (fp32)

Byte layout of a page
---------------------
vLLM hands a layer its cache as ``uint8 [num_blocks, H_kv, block_size, C]`` (layout LBHNC/"HND",
``C = state_content_bytes = bytes_per_token_head``).  One *page* is the contiguous
``block_size * C`` bytes of one (block, KV head).  Inside it (N = block_size, D = head_size,
G = key_group, VG = value_group, S = sink_tokens, every region starts 16-byte aligned)::

    offset 0 +--------------------------------------------------+
             | K codes   uint8 [N, D*bits_k/8]   token-major     |  packed per token along D
             +--------------------------------------------------+
             | V codes   uint8 [N, D*bits_v/8]   token-major     |
             +--------------------------------------------------+
             | K scale   fp16  [N/G, D]   one row per key group  |
             | K zero    fp16  [N/G, D]                          |
             +--------------------------------------------------+
             | V scale   fp16  [N, D/VG]  one row per token      |
             | V zero    fp16  [N, D/VG]                         |
             +--------------------------------------------------+
             | sink K    dtype [S, D]     (only if S > 0)        |
             | sink V    dtype [S, D]                            |
             +--------------------------------------------------+
             | residual K dtype [G, D]    (only residual="page") |
             +--------------------------------------------------+
             | padding up to N * C                               |
    N*C      +--------------------------------------------------+

Where the residual lives (and why the default is not inside the page)
---------------------------------------------------------------------
A residual area inside every page costs ``2*G*D`` bytes per page, i.e. ``2*G*D/N`` bytes per
token: with D=128, G=64, N=128 that is 128 B/token on top of 140 B/token of codes and scales
(1.9x of bf16 instead of 3.66x).  The area is needed only by the one partially filled page of each
running sequence, so by default (``residual="tail"``) it lives outside the page in a small pool
``k_tail [num_entries, H_kv, G, D]`` owned by the integration: every token write names the tail
entry of its key group (``tail_mapping``) and attention names the entry holding each sequence's
unfinished group (``tail_index``).  All tokens of one key group must use the same entry; using a
different entry for consecutive groups (e.g. two entries per sequence, alternating with the group
index, or a vLLM-managed sliding-window group with block size G) keeps a group intact when
speculative decoding rolls back across a group boundary.  ``residual="page"`` keeps the area in the
page (self-contained, entry = page index, no integration state) at the capacity cost above.

Full pages never need the tail (all their groups are quantized), so prefix-cached pages are
self-contained in both modes.

Capacity (fp16 scales/zeros, residual="tail", S=0; bf16 K+V = 4*D bytes per token and head)
------------------------------------------------------------------------------------------
bytes/token/head = D*bits_k/8 + D*bits_v/8 + 4*D/G + 4*D/VG  (+ 4*S*D/N with sinks)::

    preset       bits K/V  G   VG  S   D=64: B/tok  ratio   D=128: B/tok  ratio
    kivi_4bit    4/4       64  D   0        72      3.56x         140      3.66x
    kivi_2bit    2/2       64  D   0        40      6.40x          76      6.74x
    kivi_k4v2    4/2       64  D   4        64      4.00x         124      4.13x   (N=128)

``value_group = D`` (one scale/zero per value row) is what measurements.md measured (KIVI-4
4.75 bits, KIVI-2 2.75 bits at G=32), costs 4 B/token, and lets the fused attention kernel fold
the value scale into the softmax weights (no per-element value dequantization); 64-channel value
groups cost 4 B/token more at D=128 (kivi_4bit 3.56x, kivi_2bit 6.40x) and remain available.

(``KiviLayout.bytes_per_token_head`` and ``capacity_ratio_vs_bf16`` compute these.)  32-token
key groups would cost 8 B/token more at D=128 (4-bit: 148 B, 3.46x; measurements.md's 3.4x):
that is why the key group is 64 tokens.  The tail is not part of the page (vLLM does not count
it): it adds ``entries * G * D * 2`` bytes per sequence and KV head (32 KiB for two entries at
G=64, D=128), i.e. 4 B/token at 8K context and 16 B/token at 2K:
``bytes_per_token_head_at(seq_len)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch

SCALE_DTYPE = torch.float16
FP16_MAX = 65504.0
ALLOWED_BITS = (2, 4, 8)
ALLOWED_KEY_GROUPS = (16, 32, 64, 128)
ALLOWED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
RESIDUAL_MODES = ("tail", "page")
MAX_SINK_TOKENS = 32
REGION_ALIGN = 16
VALUE_ROTATIONS = ("none", "hadamard")

__all__ = [
    "KiviLayout",
    "KiviRegion",
    "KiviViews",
    "PRESETS",
    "quantize_groups",
    "dequantize_codes",
    "pack_codes",
    "unpack_codes",
    "fake_quant_per_token",
    "fake_quant_kv",
    "hadamard_matrix",
    "rotate_values",
    "reference_attention",
    "attention_error",
]


class KiviRegion(NamedTuple):
    """One region of a page: byte offset, byte size, element shape and element dtype."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class KiviViews(NamedTuple):
    """Typed, strided views of every region of every page of one layer's cache.

    Each view has shape ``[num_blocks, H_kv, *region.shape]`` and aliases the cache's bytes, so
    writing through a view writes the cache.  ``sink_k``/``sink_v`` are ``None`` without sinks,
    ``residual_k`` is ``None`` unless ``residual == "page"``.
    """

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    sink_k: torch.Tensor | None
    sink_v: torch.Tensor | None
    residual_k: torch.Tensor | None


def _align(n: int, a: int = REGION_ALIGN) -> int:
    return (n + a - 1) // a * a


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


@dataclasses.dataclass(frozen=True)
class KiviLayout:
    """Page layout of the KIVI cache for one attention layer (see the module docstring).

    Args:
        bits_k, bits_v: code width of keys / values, one of 2, 4, 8.
        head_size: D, a multiple of 8 (>= 16) divisible by ``value_group``.
        block_size: tokens per page (vLLM's kernel block size); a multiple of ``key_group``.
        key_group: tokens per key quantization group, one of 16, 32, 64, 128.
        value_group: channels per value quantization group (divides D, multiple of 8);
            ``None`` means D (one group per token and head).
        dtype: full-precision dtype of the residual and sink rows (the model dtype).
        sink_tokens: S full-precision token slots at the start of every page, 0 <= S < key_group.
        residual: ``"tail"`` (residual keys in an external pool) or ``"page"`` (inside the page).
        value_rotation: ``"none"`` or ``"hadamard"`` (values are stored rotated by the D x D
            Hadamard matrix; D a power of two; see the module docstring).
    """

    bits_k: int = 4
    bits_v: int = 4
    head_size: int = 128
    block_size: int = 128
    key_group: int = 64
    value_group: int | None = None
    dtype: torch.dtype = torch.bfloat16
    sink_tokens: int = 0
    residual: str = "tail"
    value_rotation: str = "none"

    def __post_init__(self) -> None:
        if self.value_group is None:
            object.__setattr__(self, "value_group", self.head_size)
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        def bad(name: str, value, allowed: str) -> ValueError:
            return ValueError(f"KiviLayout: invalid {name}={value!r}; allowed: {allowed}")

        for name in ("bits_k", "bits_v"):
            v = getattr(self, name)
            if v not in ALLOWED_BITS:
                raise bad(name, v, f"one of {ALLOWED_BITS}")
        d = self.head_size
        if not isinstance(d, int) or d < 16 or d % 8 != 0:
            raise bad("head_size", d, "a multiple of 8, at least 16")
        if self.key_group not in ALLOWED_KEY_GROUPS:
            raise bad("key_group", self.key_group, f"one of {ALLOWED_KEY_GROUPS}")
        n = self.block_size
        if not isinstance(n, int) or n <= 0 or n % self.key_group != 0:
            raise bad("block_size", n, f"a positive multiple of key_group={self.key_group}")
        vg = self.value_group
        if not isinstance(vg, int) or vg <= 0 or vg % 8 != 0 or d % vg != 0:
            raise bad("value_group", vg, f"a multiple of 8 that divides head_size={d}")
        if self.dtype not in ALLOWED_DTYPES:
            raise bad("dtype", self.dtype, "torch.bfloat16, torch.float16 or torch.float32")
        s = self.sink_tokens
        if not isinstance(s, int) or s < 0 or s >= self.key_group or s > MAX_SINK_TOKENS:
            raise bad(
                "sink_tokens",
                s,
                f"an integer 0 <= S < key_group={self.key_group} and S <= {MAX_SINK_TOKENS}",
            )
        if self.residual not in RESIDUAL_MODES:
            raise bad("residual", self.residual, f"one of {RESIDUAL_MODES}")
        if self.value_rotation not in VALUE_ROTATIONS:
            raise bad("value_rotation", self.value_rotation, f"one of {VALUE_ROTATIONS}")
        if self.value_rotation == "hadamard" and not hadamard_fits(d):
            raise bad("value_rotation", self.value_rotation,
                      f"'none' for head_size={d} ('hadamard' needs a power-of-two head size)")

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(
        cls,
        name: str,
        head_size: int,
        block_size: int = 128,
        dtype: torch.dtype = torch.bfloat16,
        **overrides,
    ) -> KiviLayout:
        """Layout of a named format (``kivi_4bit``, ``kivi_2bit``, ``kivi_k4v2``)."""
        if name not in PRESETS:
            raise ValueError(
                f"KiviLayout.preset: unknown name={name!r}; allowed: {sorted(PRESETS)}"
            )
        kw = dict(PRESETS[name])
        kw.update(overrides)
        return cls(head_size=head_size, block_size=block_size, dtype=dtype, **kw)

    # ------------------------------------------------------------------ sizes
    @property
    def codes_per_byte_k(self) -> int:
        return 8 // self.bits_k

    @property
    def codes_per_byte_v(self) -> int:
        return 8 // self.bits_v

    @property
    def k_row_bytes(self) -> int:
        return self.head_size * self.bits_k // 8

    @property
    def v_row_bytes(self) -> int:
        return self.head_size * self.bits_v // 8

    @property
    def groups_per_page(self) -> int:
        return self.block_size // self.key_group

    @property
    def value_groups_per_token(self) -> int:
        return self.head_size // self.value_group

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @functools.cached_property
    def regions(self) -> dict[str, KiviRegion]:
        """Ordered regions of one page (name -> KiviRegion); see the module docstring."""
        n, d, s = self.block_size, self.head_size, self.sink_tokens
        specs: list[tuple[str, tuple[int, ...], torch.dtype]] = [
            ("k_codes", (n, self.k_row_bytes), torch.uint8),
            ("v_codes", (n, self.v_row_bytes), torch.uint8),
            ("k_scale", (self.groups_per_page, d), SCALE_DTYPE),
            ("k_zero", (self.groups_per_page, d), SCALE_DTYPE),
            ("v_scale", (n, self.value_groups_per_token), SCALE_DTYPE),
            ("v_zero", (n, self.value_groups_per_token), SCALE_DTYPE),
        ]
        if s > 0:
            specs += [("sink_k", (s, d), self.dtype), ("sink_v", (s, d), self.dtype)]
        if self.residual == "page":
            specs.append(("residual_k", (self.key_group, d), self.dtype))
        out: dict[str, KiviRegion] = {}
        off = 0
        for name, shape, dt in specs:
            off = _align(off)
            nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            out[name] = KiviRegion(off, nbytes, shape, dt)
            off += nbytes
        return out

    @property
    def used_page_bytes(self) -> int:
        """Bytes of a page that hold data (before padding to ``block_size * C``)."""
        last = list(self.regions.values())[-1]
        return last.offset + last.nbytes

    @property
    def bytes_per_token_head(self) -> int:
        """C = vLLM's ``state_content_bytes``: bytes per token and KV head (sinks amortised)."""
        return -(-self.used_page_bytes // self.block_size)

    @property
    def page_bytes(self) -> int:
        """Bytes of one (block, KV head) page: ``block_size * bytes_per_token_head``."""
        return self.block_size * self.bytes_per_token_head

    @property
    def capacity_ratio_vs_bf16(self) -> float:
        """Tokens that fit in the same memory relative to bf16 K+V (4*D bytes per token-head)."""
        return 4 * self.head_size / self.bytes_per_token_head

    @property
    def tail_entry_bytes(self) -> int:
        """Bytes of one tail entry per KV head (0 when the residual lives in the page)."""
        if self.residual == "page":
            return 0
        return self.key_group * self.head_size * self.dtype_bytes

    def bytes_per_token_head_at(self, seq_len: int, tail_entries_per_seq: int = 2) -> float:
        """True bytes per token and head for one sequence of ``seq_len`` tokens, tail included."""
        if seq_len <= 0:
            raise ValueError(f"bytes_per_token_head_at: invalid seq_len={seq_len}; allowed: > 0")
        pages = -(-seq_len // self.block_size)
        total = pages * self.page_bytes + tail_entries_per_seq * self.tail_entry_bytes
        return total / seq_len

    def describe(self) -> str:
        """One line: bits, groups, bytes per token and capacity ratio."""
        return (
            f"K{self.bits_k}/V{self.bits_v} D={self.head_size} N={self.block_size} "
            f"G={self.key_group} VG={self.value_group} S={self.sink_tokens} "
            f"residual={self.residual} dtype={_dtype_name(self.dtype)}"
            f"{' values Hadamard-rotated' if self.value_rotation == 'hadamard' else ''}: "
            f"{self.bytes_per_token_head} B/token/head, {self.capacity_ratio_vs_bf16:.2f}x bf16"
        )

    # ------------------------------------------------------------------ cache views
    def page_view(self, cache: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, H_kv, page_bytes]`` uint8 view of a layer cache (no copy).

        Accepts ``[num_blocks, H, block_size, C]`` (vLLM's per-layer view in LBHNC layout) or
        ``[num_blocks, H, page_bytes]``; the bytes of one (block, head) must be contiguous.
        """
        if cache.dtype != torch.uint8:
            raise ValueError(f"KIVI cache: invalid dtype={cache.dtype}; allowed: torch.uint8")
        c = self.bytes_per_token_head
        if cache.dim() == 4:
            if tuple(cache.shape[2:]) != (self.block_size, c):
                raise ValueError(
                    f"KIVI cache: invalid shape={tuple(cache.shape)}; allowed: "
                    f"[num_blocks, H, {self.block_size}, {c}] for {self.describe()}"
                )
            if cache.stride(3) != 1 or cache.stride(2) != c:
                raise ValueError(
                    f"KIVI cache: invalid strides={cache.stride()}; allowed: the (block_size, C) "
                    "bytes of a (block, head) contiguous (KV cache layout HND / LBHNC)"
                )
            return cache.view(cache.shape[0], cache.shape[1], self.page_bytes)
        if cache.dim() == 3:
            if cache.shape[2] != self.page_bytes or cache.stride(2) != 1:
                raise ValueError(
                    f"KIVI cache: invalid shape={tuple(cache.shape)}; allowed: "
                    f"[num_blocks, H, {self.page_bytes}] with a contiguous last dim"
                )
            return cache
        raise ValueError(f"KIVI cache: invalid rank={cache.dim()}; allowed: 3 or 4")

    def views(self, cache: torch.Tensor) -> KiviViews:
        """Typed views of all page regions of ``cache`` (they alias the cache's storage)."""
        pv = self.page_view(cache)
        out = {}
        for name, reg in self.regions.items():
            raw = pv[:, :, reg.offset : reg.offset + reg.nbytes]
            if reg.dtype != torch.uint8:
                raw = raw.view(reg.dtype)
            out[name] = raw.unflatten(-1, reg.shape)
        return KiviViews(
            k_codes=out["k_codes"],
            v_codes=out["v_codes"],
            k_scale=out["k_scale"],
            k_zero=out["k_zero"],
            v_scale=out["v_scale"],
            v_zero=out["v_zero"],
            sink_k=out.get("sink_k"),
            sink_v=out.get("sink_v"),
            residual_k=out.get("residual_k"),
        )

    def allocate(self, num_blocks: int, num_kv_heads: int, device="cpu") -> torch.Tensor:
        """A zeroed cache ``uint8 [num_blocks, H_kv, block_size, C]`` (tests and benchmarks)."""
        return torch.zeros(
            num_blocks,
            num_kv_heads,
            self.block_size,
            self.bytes_per_token_head,
            dtype=torch.uint8,
            device=device,
        )

    def allocate_tail(self, num_entries: int, num_kv_heads: int, device="cpu") -> torch.Tensor:
        """A zeroed tail pool ``dtype [num_entries, H_kv, key_group, D]`` (residual="tail")."""
        return torch.zeros(
            num_entries,
            num_kv_heads,
            self.key_group,
            self.head_size,
            dtype=self.dtype,
            device=device,
        )


# name -> KiviLayout keyword arguments (head_size/block_size/dtype come from the model)
PRESETS: dict[str, dict] = {
    "kivi_4bit": dict(bits_k=4, bits_v=4, key_group=64, value_group=None, sink_tokens=0),
    "kivi_2bit": dict(bits_k=2, bits_v=2, key_group=64, value_group=None, sink_tokens=0),
    "kivi_k4v2": dict(bits_k=4, bits_v=2, key_group=64, value_group=None, sink_tokens=4),
}


# ---------------------------------------------------------------------------------------------
# Quantization primitives (plain torch; the Triton kernels reproduce them bit for bit)
# ---------------------------------------------------------------------------------------------
def quantize_groups(
    x: torch.Tensor, bits: int, dim: int, exclude: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization of ``x`` with one (scale, zero) per slice along ``dim``.

    Args:
        x: float tensor (computed in fp32).
        bits: code width.
        dim: the reduced dimension (the group).
        exclude: optional bool mask broadcastable to ``x``; True entries are left out of min/max
            (they still get clamped codes).
    Returns:
        codes (uint8, shape of x), scale and zero (fp16, ``dim`` kept with size 1).
    """
    x = x.float()
    qmax = float((1 << bits) - 1)
    if exclude is None:
        lo = x.amin(dim, keepdim=True)
        hi = x.amax(dim, keepdim=True)
    else:
        lo = torch.where(exclude, float("inf"), x).amin(dim, keepdim=True)
        hi = torch.where(exclude, float("-inf"), x).amax(dim, keepdim=True)
        empty = torch.isinf(lo)
        lo = torch.where(empty, 0.0, lo)
        hi = torch.where(empty, 0.0, hi)
    scale = ((hi - lo) / qmax).clamp(max=FP16_MAX).to(SCALE_DTYPE)
    zero = lo.clamp(-FP16_MAX, FP16_MAX).to(SCALE_DTYPE)
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.floor((x - zero.float()) / safe + 0.5).clamp(0.0, qmax).to(torch.uint8)
    return codes, scale, zero


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes * scale + zero`` in fp32 (scale/zero broadcast against codes)."""
    return codes.float() * scale.float() + zero.float()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes ``[..., D]`` into bytes ``[..., D*bits/8]`` (low channel in low bits)."""
    p = 8 // bits
    if p == 1:
        return codes.to(torch.uint8)
    d = codes.shape[-1]
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], d // p, p)
    shifts = torch.arange(p, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: bytes ``[..., B]`` -> uint8 codes ``[..., B*8/bits]``."""
    p = 8 // bits
    if p == 1:
        return packed
    shifts = torch.arange(p, device=packed.device, dtype=torch.int32) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * p).to(torch.uint8)


def _quant_dequant(x: torch.Tensor, bits: int, dim: int, exclude=None) -> torch.Tensor:
    codes, scale, zero = quantize_groups(x, bits, dim, exclude)
    return dequantize_codes(codes, scale, zero)


# ---------------------------------------------------------------------------------------------
# Fake quantization (quantize -> dequantize of whole tensors) for error studies
# ---------------------------------------------------------------------------------------------
def fake_quant_per_token(x: torch.Tensor, bits: int, group: int | None = None) -> torch.Tensor:
    """Per-(token, head) asymmetric quantization of ``x [L, H, D]`` over channel groups of ``group``
    (default: the whole head), fp16 scale/zero; returns the dequantized fp32 tensor."""
    L, H, D = x.shape
    g = D if group is None else group
    xg = x.float().reshape(L, H, D // g, g)
    return _quant_dequant(xg, bits, dim=-1).reshape(L, H, D)


def _fake_quant_keys_kivi(k: torch.Tensor, layout: KiviLayout, key_mode: str) -> torch.Tensor:
    """Keys of one sequence ``[L, H, D]`` as the paged cache returns them (fp32)."""
    L, H, D = k.shape
    G, N, S = layout.key_group, layout.block_size, layout.sink_tokens
    kf = k.to(layout.dtype).float()
    out = kf.clone()
    lq = (L // G) * G  # keys in complete groups; the rest is the full-precision residual
    if lq > 0:
        grp = kf[:lq].reshape(lq // G, G, H, D)
        pos_in_page = (torch.arange(lq, device=k.device) % N).reshape(lq // G, G)
        is_sink = (pos_in_page < S)[:, :, None, None]
        if key_mode == "channel":
            deq = _quant_dequant(grp, layout.bits_k, dim=1, exclude=is_sink if S else None)
        elif key_mode == "token":
            vg = layout.value_group
            deq = _quant_dequant(grp.reshape(lq // G, G, H, D // vg, vg), layout.bits_k, dim=-1)
            deq = deq.reshape(lq // G, G, H, D)
        else:
            raise AssertionError(key_mode)
        out[:lq] = deq.reshape(lq, H, D)
    if S:
        sink = (torch.arange(L, device=k.device) % N) < S
        out[sink] = kf[sink]
    return out


@functools.lru_cache(maxsize=8)
def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(torch.float32).to(device)


def hadamard_fits(n: int) -> bool:
    """Whether the Sylvester Hadamard matrix exists at size ``n`` (a power of two), i.e. whether
    ``value_rotation="hadamard"`` can apply at head size ``n``."""
    return n > 0 and not n & (n - 1)


def hadamard_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix ``[n, n]`` (float32; ``n`` a power of two):
    symmetric and orthogonal, so it is its own inverse.

    >>> h = hadamard_matrix(4)
    >>> torch.equal(h, h.T), torch.allclose(h @ h, torch.eye(4))
    (True, True)
    """
    if not hadamard_fits(n):
        raise ValueError(f"hadamard_matrix: n={n} must be a power of two")
    return _hadamard(n, torch.device(device))


def rotate_values(x: torch.Tensor, layout: KiviLayout) -> torch.Tensor:
    """``x @ H`` over the last dimension (D) when the layout rotates values, else ``x`` itself.

    Rotating twice is the identity, so the same call maps values into the page's space (before
    quantization) and an attention output computed over rotated values back.  Computed in
    float32, returned in ``x``'s dtype.
    """
    if layout.value_rotation == "none":
        return x
    h = hadamard_matrix(x.shape[-1], x.device)
    return (x.float() @ h).to(x.dtype)


def _fake_quant_values_kivi(v: torch.Tensor, layout: KiviLayout) -> torch.Tensor:
    L, H, D = v.shape
    vf = rotate_values(v.to(layout.dtype), layout).float()  # the rows the page stores
    out = fake_quant_per_token(vf, layout.bits_v, layout.value_group)
    if layout.sink_tokens:
        sink = (torch.arange(L, device=v.device) % layout.block_size) < layout.sink_tokens
        out[sink] = vf[sink]
    return rotate_values(out, layout)


_PER_TOKEN_FORMATS = {"int8_per_token": 8, "int4_per_token": 4, "int2_per_token": 2}


def fake_quant_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    fmt: str | KiviLayout,
    *,
    key_mode: str = "channel",
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize and dequantize the K/V of one sequence (``[L, H_kv, D]``) in a given format.

    ``fmt``: a :class:`KiviLayout` (exactly what the paged cache stores and attention reads:
    complete key groups quantized, the unfinished group and sink slots in full precision),
    a preset name (``kivi_4bit``, ``kivi_2bit``, ``kivi_k4v2``; bf16 rows, ``block_size`` tokens
    per page), ``bf16``, a per-token baseline ``int8_per_token`` / ``int4_per_token`` /
    ``int2_per_token`` (per (token, head) over D, fp16 scale/zero, no residual), or
    ``int4_per_token_head``: vLLM's format of that name, rotated and all
    (:mod:`vllm_accel.kernels.int4_per_token_head_ref`).
    ``key_mode="token"`` quantizes the keys of a KIVI format per token instead of per channel
    (same bits, channel groups of ``value_group``) to isolate the effect of the key axis.
    Returns fp32 tensors.
    """
    if key_mode not in ("channel", "token"):
        raise ValueError(
            f"fake_quant_kv: invalid key_mode={key_mode!r}; allowed: 'channel', 'token'"
        )
    if isinstance(fmt, str):
        if fmt == "bf16":
            return k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
        if fmt in _PER_TOKEN_FORMATS:
            b = _PER_TOKEN_FORMATS[fmt]
            return fake_quant_per_token(k, b), fake_quant_per_token(v, b)
        if fmt == "int4_per_token_head":
            from vllm_accel.kernels.int4_per_token_head_ref import fake_quant_int4_per_token_head

            return fake_quant_int4_per_token_head(k), fake_quant_int4_per_token_head(v)
        if fmt in PRESETS:
            fmt = KiviLayout.preset(fmt, head_size=k.shape[-1], block_size=block_size)
        else:
            allowed = ["bf16", *_PER_TOKEN_FORMATS, "int4_per_token_head", *PRESETS]
            raise ValueError(
                f"fake_quant_kv: unknown fmt={fmt!r}; allowed: {allowed} or a KiviLayout"
            )
    if k.shape[-1] != fmt.head_size:
        raise ValueError(
            f"fake_quant_kv: head_size={k.shape[-1]} does not match "
            f"layout head_size={fmt.head_size}"
        )
    return _fake_quant_keys_kivi(k, fmt, key_mode), _fake_quant_values_kivi(v, fmt)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """fp32 attention of one sequence: ``q [Lq, Hq, D]`` against ``k, v [L, H_kv, D]`` (GQA).

    With ``causal``, query i sits at position ``L - Lq + i`` (bottom-right alignment, i.e. the
    queries are the last ``Lq`` tokens of the sequence).
    """
    lq, hq, d = q.shape
    L, hkv, _ = k.shape
    rep = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, Lq, D]
    kf = k.float().transpose(0, 1).repeat_interleave(rep, 0)
    vf = v.float().transpose(0, 1).repeat_interleave(rep, 0)
    s = (qf @ kf.transpose(1, 2)) * (d**-0.5 if scale is None else scale)
    if causal:
        qpos = torch.arange(L - lq, L, device=q.device)[:, None]
        kpos = torch.arange(L, device=q.device)[None, :]
        s = s.masked_fill(kpos > qpos, float("-inf"))
    return (torch.softmax(s, -1) @ vf).transpose(0, 1)


def attention_error(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fmt: str | KiviLayout,
    *,
    key_mode: str = "channel",
    block_size: int = 128,
    scale: float | None = None,
    causal: bool = True,
) -> dict[str, float]:
    """Error of attention computed on fake-quantized K/V against the given K/V, for one layer.

    Args: ``q [Lq, Hq, D]``, ``k, v [L, H_kv, D]`` (e.g. a layer's post-RoPE keys captured from a
    model; the reference uses them as given), ``fmt``/``key_mode``/``block_size`` as in
    :func:`fake_quant_kv`.
    Returns a dict: ``out_rel`` = ||o_q - o|| / ||o|| (Frobenius), ``out_max_abs``,
    ``out_rel_max_row`` (worst (token, head) row), ``k_rel`` and ``v_rel`` (relative
    reconstruction errors of K and V).
    """
    kq, vq = fake_quant_kv(k, v, fmt, key_mode=key_mode, block_size=block_size)
    ref = reference_attention(q, k, v, scale=scale, causal=causal)
    out = reference_attention(q, kq, vq, scale=scale, causal=causal)
    diff = out - ref
    row_err = diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)
    return {
        "out_rel": float(diff.norm() / ref.norm().clamp_min(1e-12)),
        "out_max_abs": float(diff.abs().max()),
        "out_rel_max_row": float(row_err.max()),
        "k_rel": float((kq - k.float()).norm() / k.float().norm().clamp_min(1e-12)),
        "v_rel": float((vq - v.float()).norm() / v.float().norm().clamp_min(1e-12)),
    }
