"""The residual pool of ``--kv-cache-dtype kivi_*``: full-precision keys of each running request's
unfinished key group, outside vLLM's pages.

A page never holds full-precision keys (``residual="tail"``, the default): the keys of the key
group a sequence is still filling live here, in ``entries_per_slot`` entries of
``[H_kv, key_group, head_size]`` per request and layer, until the token that completes the group
quantizes it into the page (:func:`~vllm_accel.kernels.kivi_cache.quantize_on_write`). Only
running requests need an entry, so the pool costs ``slots * entries_per_slot * key_group *
head_size * 2`` bytes per layer and KV head instead of a residual area in every page.

Slots follow requests, not batch rows (rows move between steps): :class:`RequestSlots` gives a
request a slot the first time it is scheduled and takes it back once the model runner no longer
holds the request (finished or aborted; a preempted request keeps its slot, and its recompute
rewrites the group from its first key). Rows without a live request (vLLM's dummy and profiling
runs) write into a scratch slot that no request owns.

No vLLM import: the builder (:mod:`vllm_accel.kv_quant.backend`) feeds it the step's request ids.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from vllm_accel.kernels.kivi_cache import tail_entries
from vllm_accel.log import get_logger

logger = get_logger("kv_quant")

SCRATCH_SLOT = 0


def entries_per_request(speculative: bool) -> int:
    """Pool entries per request: two with speculative decoding (drafts rolled back across a
    group boundary must not clobber the previous group's rows), else one."""
    return 2 if speculative else 1


def pool_bytes(*, num_layers: int, num_kv_heads: int, key_group: int, head_size: int,
               max_requests: int, entries_per_slot: int, dtype_bytes: int = 2) -> int:
    """Bytes of a :class:`TailPool` (``max_requests`` slots plus the scratch slot)."""
    entries = entries_per_slot * (max_requests + 1)
    return num_layers * entries * num_kv_heads * key_group * head_size * dtype_bytes


class RequestSlots:
    """Stable slot numbers ``1 .. capacity`` for requests; slot 0 is the scratch slot."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"KIVI residual pool: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = list(range(capacity, 0, -1))  # pop() hands out 1 first

    def __len__(self) -> int:
        return len(self._slot_of)

    def grow(self, capacity: int) -> None:
        self._free = list(range(capacity, self.capacity, -1)) + self._free
        self.capacity = capacity

    def assign(self, row_req_ids: Sequence[str | None],
               live_req_ids: Collection[str]) -> list[int] | None:
        """The slot of each batch row, after freeing the slots of requests no longer live.

        Returns None (and assigns nothing) when the rows need more slots than are free: the
        caller grows the pool and asks again.
        """
        for req_id in [r for r in self._slot_of if r not in live_req_ids]:
            self._free.append(self._slot_of.pop(req_id))
        new = {r for r in row_req_ids if r is not None and r in live_req_ids
               and r not in self._slot_of}
        if len(new) > len(self._free):
            return None
        for req_id in sorted(new):
            self._slot_of[req_id] = self._free.pop()
        return [self._slot_of.get(r, SCRATCH_SLOT) if r is not None else SCRATCH_SLOT
                for r in row_req_ids]


class TailPool:
    """Residual keys of all layers of one KV-cache group: ``dtype [L, E*(S+1), H_kv, G, D]``."""

    def __init__(self, layer_names: Sequence[str], *, num_kv_heads: int, key_group: int,
                 head_size: int, dtype: torch.dtype, device: torch.device | str,
                 max_requests: int, entries_per_slot: int) -> None:
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.entries_per_slot = entries_per_slot
        self.key_group = key_group
        self._row_shape = (num_kv_heads, key_group, head_size)
        self.slots = RequestSlots(max_requests)
        self.keys = self._allocate(len(layer_names), max_requests, dtype, device)

    def _allocate(self, num_layers: int, max_requests: int, dtype: torch.dtype,
                  device: torch.device | str) -> torch.Tensor:
        entries = self.entries_per_slot * (max_requests + 1)  # + the scratch slot (pool_bytes)
        return torch.zeros((num_layers, entries, *self._row_shape), dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size()

    def describe(self) -> str:
        layers, entries = self.keys.shape[:2]
        return (f"{self.slots.capacity} request slots x {self.entries_per_slot} entries x "
                f"{layers} layers of {list(self._row_shape)} {str(self.keys.dtype)[6:]} keys = "
                f"{self.nbytes / 2**20:.1f} MiB outside the KV-cache budget")

    def layer(self, layer_name: str) -> torch.Tensor:
        """``[entries, H_kv, G, D]`` of one layer (a view; valid for the current step)."""
        return self.keys[self.layer_index[layer_name]]

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.slots.capacity)
        old = self.keys
        self.keys = self._allocate(old.shape[0], capacity, old.dtype, old.device)
        self.keys[:, :old.shape[1]] = old
        self.slots.grow(capacity)
        logger.warning("KIVI residual pool grown to %s (more live requests than "
                       "--max-num-seqs: preempted requests keep their slots)", self.describe())

    def step(self, row_req_ids: Sequence[str | None], live_req_ids: Collection[str],
             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
             padded_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``tail_mapping [padded_tokens]`` (entry of each written key; padding writes into the
        scratch slot) and ``tail_index [R]`` (entry of each row's unfinished group) for one
        step's batch of ``num_tokens`` real tokens."""
        slots = self.slots.assign(row_req_ids, live_req_ids)
        if slots is None:
            self._grow(len(self.slots) + len(row_req_ids))
            slots = self.slots.assign(row_req_ids, live_req_ids)
        tail_mapping, tail_index = tail_entries(
            query_start_loc, seq_lens, self.key_group,
            request_slots=torch.tensor(slots, dtype=torch.int64),
            entries_per_slot=self.entries_per_slot, num_tokens=num_tokens)
        if padded_tokens is not None and padded_tokens > num_tokens:
            tail_mapping = torch.nn.functional.pad(tail_mapping,
                                                   (0, padded_tokens - num_tokens))
        return tail_mapping, tail_index
