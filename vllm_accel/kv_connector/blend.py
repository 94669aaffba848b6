"""Selective recompute: the connector computes chosen claimed tokens itself, before the forward.

After the stored chunks are written into a request's pages, some claimed tokens must be
recomputed so that chunks "see" each other (and tokens whose chunk could not be loaded must be
computed at all). :func:`recompute_tokens` runs the model's own decoder layers on those rows
only, layer by layer, in their true positions. Inside each layer the model's attention module is
swapped for :class:`_PagedRowAttention`, which writes the rows' fresh K/V into the pages (over the
loaded KV) and lets each row attend causally to the request's pages: loaded KV for the other
tokens, fresh KV for the recomputed ones. Norms, projections, RoPE, MLP are the model's code, so
any decoder whose attention calls ``self.attn(q, k, v)`` works (Llama, Qwen2, ...).

Policies (``recompute`` knob):

* ``none`` — only the tokens without stored KV (naive reuse);
* ``epic`` — plus the first ``epic_tokens`` of every reused chunk (EPIC / LegoLink: the chunk's
  attention-sink tokens are the ones whose KV is most wrong out of context);
* ``cacheblend`` — layer 0 runs on every claimed token; at layer 1 the rows whose fresh keys
  deviate most from the loaded keys (top ``recompute_ratio`` of the reused tokens) are kept and
  only they run layers 2..L-1 (CacheBlend's selection by KV deviation). Layers 0 and 1 get fresh
  KV for every claimed token;
* ``query`` — the question probes first (:func:`question_attention_peaks`): its tokens run
  every layer over the loaded pages, writing nothing; the reused tokens its upper-layer heads
  read most sharply, each with ``query_window`` neighbours on either side, up to
  ``recompute_ratio`` of the reused tokens, then run every layer (user-query-driven selection
  as in ProphetKV: the budget goes to what the question reads, not to tokens that deviate most
  but do not matter for it).

The model handle comes from :func:`register_model`, called by the model transform when the
engine runs this connector (``vllm_accel.model_transforms``).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_accel.kv_connector.paged_kv import PagedLayerKV

# recomputed rows attend in blocks of this many; a block reads the keys up to its last row, so
# small blocks skip most causally masked keys (64: 1.7x less attention time than one 512-row
# block reading every key, for ~600 rows spread over 4K positions on 2 AVX-512 cores)
_QUERY_ROWS_PER_BLOCK = 64
_PROBE_ROWS_PER_SDPA = 512  # bounds the [rows, keys] mask of one attention call
_PROBE_ROWS_PER_BLOCK = 64  # probe logits are [H, rows, keys] in float32
_model_ref: weakref.ReferenceType | None = None


def register_model(model: nn.Module) -> None:
    global _model_ref
    _model_ref = weakref.ref(model)


def registered_model() -> nn.Module | None:
    return _model_ref() if _model_ref is not None else None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)


def rotary_of(model: nn.Module) -> nn.Module:
    return decoder_layers(model)[0].self_attn.rotary_emb


class _PagedStandIn(nn.Module):
    """Base of the modules that stand in for a layer's ``attn`` module over one request's
    pages: the layer's head geometry and softmax scale, the pages and the block table."""

    def __init__(self, attn: nn.Module, paged: PagedLayerKV, block_table: torch.Tensor):
        super().__init__()
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_size, self.scale = attn.head_size, attn.impl.scale
        self.paged, self.block_table = paged, block_table


class _PagedRowAttention(_PagedStandIn):
    """Stands in for a layer's ``attn`` module: rows attend to their request's pages."""

    def __init__(self, attn: nn.Module, paged: PagedLayerKV, block_table: torch.Tensor,
                 positions: torch.Tensor, candidates: torch.Tensor | None = None,
                 ratio: float = 0.0):
        super().__init__(attn, paged, block_table)
        self.positions = positions
        self.candidates, self.ratio = candidates, ratio
        self.keep: torch.Tensor | None = None

    def _select(self, fresh_k: torch.Tensor) -> torch.Tensor:
        """Row indices to keep: non-candidates (tokens that had no stored KV) and the top
        ``ratio`` of candidates by key deviation from the loaded keys."""
        loaded_k, _ = self.paged.read(self.block_table, self.positions)
        deviation = (fresh_k.float() - loaded_k.float()).square().sum(dim=(1, 2))
        cand = self.candidates
        num_keep = math.ceil(self.ratio * int(cand.sum()))
        score = torch.where(cand, deviation, torch.full_like(deviation, float("inf")))
        num_rows = int((~cand).sum()) + num_keep
        return torch.topk(score, num_rows).indices.sort().values

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, d = q.shape[0], self.head_size
        q = q.view(n, self.num_heads, d)
        k, v = k.view(n, self.num_kv_heads, d), v.view(n, self.num_kv_heads, d)
        if self.candidates is not None:
            self.keep = self._select(k)
        self.paged.write(self.block_table, self.positions, k, v)
        num_keys = int(self.positions.max()) + 1
        key_pos = torch.arange(num_keys, device=q.device)
        keys, values = self.paged.read(self.block_table, key_pos)
        keys = keys.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, H_kv, S, D]
        values = values.transpose(0, 1).unsqueeze(0).to(q.dtype)
        out = torch.empty_like(q)
        for lo in range(0, n, _QUERY_ROWS_PER_BLOCK):
            hi = min(n, lo + _QUERY_ROWS_PER_BLOCK)
            # a block reads only the keys up to its last row (rows come sorted by position)
            seen = int(self.positions[lo:hi].max()) + 1
            visible = key_pos[None, :seen] <= self.positions[lo:hi, None]
            out[lo:hi] = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1).unsqueeze(0), keys[:, :, :seen], values[:, :, :seen],
                attn_mask=visible[None, None], scale=self.scale, enable_gqa=True,
            )[0].transpose(0, 1)
        return out.reshape(n, self.num_heads * d)


class _ProbeAttention(_PagedStandIn):
    """Stands in for a layer's ``attn`` module while query rows probe the pages: the rows attend
    to the page keys ``[0, first)`` that are ``key_valid``, to the rows of earlier calls (kept
    here, never written to the pages) and causally to each other; calls continue the positions
    ``first, first+1, ...``, ``capacity`` rows in all. The pages are gathered once, on the first
    call, and kept with the rows until :meth:`release` (in float32 when ``scored``: the scored
    attention runs in float32). With ``score_rows`` (bool per row of each call; ``None`` in a
    layer that is not ``scored``), ``peak`` gets, per page position, the largest attention
    probability any head gives it from those rows."""

    def __init__(self, attn: nn.Module, paged: PagedLayerKV, block_table: torch.Tensor,
                 key_valid: torch.Tensor, capacity: int, scored: bool):
        super().__init__(attn, paged, block_table)
        self.key_valid, self.score_rows, self.capacity = key_valid, None, capacity
        self.scored = scored
        self.peak = torch.zeros(key_valid.numel(), dtype=torch.float32, device=key_valid.device)
        self.keys: torch.Tensor | None = None  # [first + capacity, H_kv, D]: pages, then rows
        self.values: torch.Tensor | None = None
        self.earlier = 0  # rows of earlier calls

    def release(self) -> None:
        self.keys = self.values = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, d, first = q.shape[0], self.head_size, self.key_valid.numel()
        if self.keys is None:
            page_k, page_v = self.paged.read(self.block_table,
                                             torch.arange(first, device=q.device))
            shape = (first + self.capacity, self.num_kv_heads, d)
            dtype = torch.float32 if self.scored else k.dtype
            self.keys = k.new_empty(shape, dtype=dtype)
            self.values = v.new_empty(shape, dtype=dtype)
            self.keys[:first], self.values[:first] = page_k, page_v
        earlier, end = self.earlier, first + self.earlier + n
        self.keys[first + earlier:end] = k.view(n, self.num_kv_heads, d)
        self.values[first + earlier:end] = v.view(n, self.num_kv_heads, d)
        self.earlier += n
        keys, values = self.keys[:end], self.values[:end]
        q = q.view(n, self.num_heads, d)
        rows = torch.arange(earlier + n, device=q.device)
        out = torch.empty_like(q)
        for lo in range(0, n, _PROBE_ROWS_PER_SDPA):
            hi = min(n, lo + _PROBE_ROWS_PER_SDPA)
            visible = torch.cat([self.key_valid[None, :].expand(hi - lo, first),
                                 rows[None, :] <= rows[earlier + lo:earlier + hi, None]], dim=1)
            if self.score_rows is None:
                out[lo:hi] = F.scaled_dot_product_attention(
                    q[lo:hi].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                    values.transpose(0, 1).unsqueeze(0), attn_mask=visible[None, None],
                    scale=self.scale, enable_gqa=True)[0].transpose(0, 1)
            else:
                out[lo:hi] = self._attend_and_score(q[lo:hi], keys, values, visible,
                                                    self.score_rows[lo:hi])
        return out.reshape(n, self.num_heads * d)

    def _attend_and_score(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          visible: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        """The rows' attention output from explicit float32 probabilities
        (``_PROBE_ROWS_PER_BLOCK`` rows at a time), raising ``peak`` to the probabilities the
        ``scored`` rows give the page keys; ``keys`` and ``values`` are float32 (a scored
        probe's buffers)."""
        n, first, group = q.shape[0], self.key_valid.numel(), self.num_heads // self.num_kv_heads
        # query head h * group + g reads kv head h (GQA), without copying keys per query head
        q = q.reshape(n, self.num_kv_heads, group, self.head_size).float()
        out = torch.empty_like(q)
        for lo in range(0, n, _PROBE_ROWS_PER_BLOCK):
            hi = min(n, lo + _PROBE_ROWS_PER_BLOCK)
            logits = torch.einsum("nhgd,khd->hgnk", q[lo:hi], keys) * self.scale
            probs = logits.masked_fill(~visible[lo:hi], float("-inf")).softmax(dim=-1)
            if scored[lo:hi].any():
                peak = probs[:, :, scored[lo:hi], :first].amax(dim=(0, 1, 2))
                self.peak = torch.maximum(self.peak, peak)
            out[lo:hi] = torch.einsum("hgnk,khd->nhgd", probs, values)
        return out.view(n, self.num_heads, self.head_size)


def question_attention_peaks(model: nn.Module, layers_kv: list[PagedLayerKV],
                             block_table: torch.Tensor, token_ids: torch.Tensor,
                             key_valid: torch.Tensor, score_from: int,
                             first_scored_layer: int, draft_tokens: int = 0
                             ) -> tuple[torch.Tensor, int]:
    """Probe the pages with the prompt's uncached suffix: ``token_ids`` at positions ``first,
    first+1, ...`` (``first = key_valid.numel()``) run every decoder layer attending to the
    valid page keys ``[0, first)`` (``key_valid``, bool per position) and to each other,
    writing nothing. With ``draft_tokens``, the probe then decodes that many tokens greedily
    over the same keys (a draft of the answer, from the loaded KV as it is), each also scored.

    Returns, per page position, the largest attention probability that any head of the layers
    from ``first_scored_layer`` on gives it from a suffix row at a position ``>= score_from``
    (the question) or a draft row, and the token-layers run. Upper-layer heads that read a
    token sharply (retrieval) mark the tokens whose approximate KV matters most for the answer;
    summed mass would instead favour the many tokens near the question that every head reads a
    little. The draft's rows add what writing the answer reads, e.g. the other documents' values
    the answer could be confused with. While a draft runs, every layer keeps its gathered pages
    (a dense copy of the prompt's K/V, in float32 from ``first_scored_layer`` on); without one,
    each layer's copy is freed when the layer is done.
    """
    first = key_valid.numel()
    positions = torch.arange(first, first + token_ids.numel(), device=token_ids.device)
    layers = decoder_layers(model)
    probes = [_ProbeAttention(layer.self_attn.attn, paged, block_table, key_valid,
                              token_ids.numel() + draft_tokens, index >= first_scored_layer)
              for index, (layer, paged) in enumerate(zip(layers, layers_kv))]
    rows = 0
    with torch.inference_mode():
        for step in range(draft_tokens + 1):
            last_pass = step == draft_tokens
            hidden, residual = model.model.embed_input_ids(token_ids), None
            for layer, probe in zip(layers, probes):
                probe.score_rows = positions >= score_from if probe.scored else None
                hidden, residual = _run_layer(layer, probe, positions, hidden, residual)
                if last_pass:  # this layer's keys are done
                    probe.release()
            rows += int(positions.numel())
            if last_pass:
                break
            last, _ = model.model.norm(hidden[-1:], residual[-1:])
            token_ids = model.compute_logits(last).argmax(dim=-1)
            positions = positions[-1:] + 1
    peak = torch.zeros(first, dtype=torch.float32, device=token_ids.device)
    for probe in probes[first_scored_layer:]:
        peak = torch.maximum(peak, probe.peak)
    return peak, rows * len(layers)


def _run_layer(layer: nn.Module, stand_in: nn.Module, positions: torch.Tensor,
               hidden: torch.Tensor, residual: torch.Tensor | None):
    """One decoder layer with its attention module swapped for ``stand_in``."""
    original = layer.self_attn.attn
    layer.self_attn.attn = stand_in
    try:
        return layer(positions, hidden, residual)
    finally:
        layer.self_attn.attn = original


@dataclass
class RecomputeResult:
    rows_per_layer: list[int]
    last_positions: torch.Tensor  # the rows that ran the last layer

    @property
    def token_layers(self) -> int:
        return sum(self.rows_per_layer)


def recompute_tokens(model: nn.Module, layers_kv: list[PagedLayerKV], block_table: torch.Tensor,
                     token_ids: torch.Tensor, positions: torch.Tensor,
                     candidates: torch.Tensor | None = None, ratio: float = 0.0,
                     select_layer: int = 1) -> RecomputeResult:
    """Run the decoder layers on ``positions`` (sorted) of one request, writing their K/V.

    ``token_ids[i]`` is the token at ``positions[i]``. With ``candidates`` (bool per row), rows
    are narrowed at ``select_layer`` to the non-candidates plus the top ``ratio`` of candidates
    by key deviation (CacheBlend); without, every row runs every layer.
    """
    layers = decoder_layers(model)
    rows: list[int] = []
    with torch.inference_mode():
        hidden = model.model.embed_input_ids(token_ids)
        residual = None
        for index, (layer, paged) in enumerate(zip(layers, layers_kv)):
            select = candidates is not None and index == select_layer
            stand_in = _PagedRowAttention(layer.self_attn.attn, paged, block_table, positions,
                                          candidates if select else None, ratio)
            hidden, residual = _run_layer(layer, stand_in, positions, hidden, residual)
            rows.append(int(positions.numel()))
            if select and stand_in.keep is not None:
                keep = stand_in.keep
                hidden, residual = hidden[keep], residual[keep]
                positions, token_ids = positions[keep], token_ids[keep]
    return RecomputeResult(rows, positions)
