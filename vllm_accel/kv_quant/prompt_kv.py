"""Unquantized K/V of prompts whose prefill spans several engine steps (``prompt_exact_tokens``).

With ``prefill_kv: exact`` a prefill step attends to its own tokens unquantized, but vLLM
writes every step into the quantized pages, so a prompt split by chunked prefill (vLLM's CPU
default is 2,048 tokens a step) reads its earlier steps back quantized: its later tokens see a
different prompt than they would in one step, and SmolLM2 loses multi-value retrieval that way
(docs/kv_quant.md, section "Prefill"). KIVI's reference prefills the whole prompt in full
precision and quantizes afterwards.

This buffer keeps, per request, the unquantized K/V its earlier prefill steps computed, until
the prompt is complete: a step then attends to ``[cached prefix: quantized pages][earlier steps
of this prefill: exact][its own tokens: exact]``, which for a prompt without a prefix-cache hit
is what one-step prefill computes. Tokens outside the buffer (a prefix-cache hit, or whatever
the capacity left out) are read from the pages, as before.

* **Capacity**: ``prompt_exact_tokens`` tokens over all requests (a KIVI knob, default 8192;
  0 turns the buffer off), each token costing ``layers * kv_heads * head_size * 2`` elements in
  the model dtype. Requests are served in batch-row order; one that does not fit keeps the
  latest tokens that do, or nothing.
* **Lifetime**: an entry is created by a prefill step that does not finish its prompt, extended
  by the next one, and dropped when the prompt is complete, when the request takes a decode or
  draft-verification step, when a step's context is not where the entry ends (preemption,
  recompute), or when the model runner no longer holds the request.

The builder plans a step once (:meth:`PromptKvBuffer.plan`); each attention layer then reads
its rows' exact context (:meth:`PromptKvStep.context`) and stores its new rows
(:meth:`PromptKvStep.store`). No vLLM import.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["PromptKvBuffer", "PromptKvStep", "buffer_bytes"]

KV = tuple[torch.Tensor, torch.Tensor]


def buffer_bytes(*, capacity_tokens: int, num_layers: int, num_kv_heads: int, head_size: int,
                 dtype_bytes: int) -> int:
    """The most memory the buffer holds: ``capacity_tokens`` tokens of K and V in every layer."""
    return capacity_tokens * num_layers * num_kv_heads * head_size * 2 * dtype_bytes


@dataclass
class _Entry:
    start: int  # first prompt position held once the step's layers have stored
    end: int  # one past the last position held: the next step's context length
    layers: dict[str, KV] = field(default_factory=dict)  # each ends at ``end``

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class _RowPlan:
    entry: _Entry
    q0: int  # the row's tokens in the step's batch
    q1: int
    reads: bool  # the entry holds the positions right before the row's own tokens
    keep: int  # tokens the entry keeps after the step (0: store nothing)


class PromptKvStep:
    """One step's plan: which rows read exact context, and which rows' K/V are kept."""

    def __init__(self, num_rows: int, rows: dict[int, _RowPlan]) -> None:
        self.num_rows = num_rows
        self.rows = rows

    def context(self, layer_name: str) -> list[KV | None]:
        """Per row, the unquantized K/V ``[e, H_kv, D]`` of the ``e`` context positions right
        before its own tokens (None: the row reads its whole context from the pages). Call
        before :meth:`store` of the same layer."""
        out: list[KV | None] = [None] * self.num_rows
        for i, row in self.rows.items():
            if row.reads:
                out[i] = row.entry.layers.get(layer_name)
        return out

    def store(self, layer_name: str, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep the rows' new K/V (``key``/``value``: the step's ``[T, H_kv, D]``) after what
        their entries hold, up to the planned number of tokens."""
        for row in self.rows.values():
            if not row.keep:
                continue
            held = row.entry.layers.get(layer_name) if row.reads else None
            k_held, v_held = held if held is not None else (None, None)
            rows = slice(row.q0, row.q1)
            row.entry.layers[layer_name] = (_append(k_held, key[rows], row.keep),
                                            _append(v_held, value[rows], row.keep))


def _append(held: torch.Tensor | None, new: torch.Tensor, keep: int) -> torch.Tensor:
    """The last ``keep`` rows of ``held`` followed by ``new``, in memory of their own (``new``
    is a view of the model's step buffers)."""
    if held is None:
        return new[-keep:].clone()
    joined = torch.cat((held, new))
    return joined[-keep:].clone() if joined.shape[0] > keep else joined


class PromptKvBuffer:
    """Per-request unquantized prompt K/V of one engine, at most ``capacity_tokens`` tokens."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"PromptKvBuffer: capacity_tokens={capacity_tokens} must be > 0")
        self.capacity_tokens = capacity_tokens
        self._entries: dict[str, _Entry] = {}

    def held_tokens(self) -> int:
        return sum(e.tokens for e in self._entries.values())

    def plan(self, row_req_ids: Sequence[str | None], live_req_ids: Collection[str],
             query_start_loc: Sequence[int], seq_lens: Sequence[int],
             prompt_lens: Sequence[int], min_rows: int) -> PromptKvStep | None:
        """The step's plan for batch rows ``i`` (request ``row_req_ids[i]``, tokens
        ``query_start_loc[i]:query_start_loc[i+1]``, ``seq_lens[i]`` tokens with this step's,
        a prompt of ``prompt_lens[i]``). Rows with fewer than ``min_rows`` tokens (decode,
        draft verification) read the pages only and end their request's entry. None when no
        row reads or keeps anything."""
        for gone in [r for r in self._entries if r not in live_req_ids]:
            del self._entries[gone]
        scheduled = {r: i for i, r in enumerate(row_req_ids)
                     if r is not None and query_start_loc[i + 1] > query_start_loc[i]}
        free = self.capacity_tokens - sum(e.tokens for r, e in self._entries.items()
                                          if r not in scheduled)
        rows: dict[int, _RowPlan] = {}
        for r, i in scheduled.items():
            q0, q1, seq_len = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
            old = self._entries.pop(r, None)
            if q1 - q0 < min_rows:
                continue
            ctx = seq_len - (q1 - q0)
            reads = old is not None and old.end == ctx
            keep = 0
            if seq_len < prompt_lens[i]:  # more prefill steps follow: keep the prompt so far
                keep = max(0, min(seq_len - (old.start if reads else ctx), free))
            if not (reads or keep):
                continue
            entry = old if reads else _Entry(start=ctx, end=ctx)
            if keep:
                entry.start, entry.end = seq_len - keep, seq_len
                self._entries[r] = entry
                free -= keep
            rows[i] = _RowPlan(entry, q0, q1, reads, keep)
        return PromptKvStep(len(row_req_ids), rows) if rows else None
