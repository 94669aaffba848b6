"""Which rows of a vLLM batch run SPEED's upper layers, and their per-request layout.

A vLLM step flattens the scheduled tokens of all requests into one batch (request ``r`` owns rows
``query_start_loc[r] : query_start_loc[r+1]``, at ``positions``). Under SPEED a row runs the upper
layers iff its position is an anchor (``< anchor_tokens``) or at/after its request's last prompt
token (``>= prompt_len - 1``): that covers the first chunk's anchors, the final chunk's last
prompt token (whose logits give the first output), decode and speculative tokens, and the output
tokens a preempted request replays when it is recomputed. Every row whose logits are sampled is
among them. This is the model transform's gather/scatter index and the upper layers' new
``query_start_loc``. Pure torch, no vLLM import; device-agnostic and free of host syncs except
where noted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_accel.kernels.speed_attention import upper_active


@dataclass(frozen=True)
class UpperRows:
    """The upper-layer sub-batch of one step."""

    #: Row indices into the step's flattened tokens, ascending ``[num_upper]``.
    rows: torch.Tensor
    #: ``[num_reqs + 1]`` offsets of each request's upper rows within ``rows``.
    query_start_loc: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.rows.numel())


def upper_row_mask(positions: torch.Tensor, query_start_loc: torch.Tensor,
                   prompt_lens: torch.Tensor, anchor_tokens: int) -> torch.Tensor:
    """Boolean ``[num_tokens]``: which of the step's tokens run the upper layers.

    ``positions`` ``[num_tokens]``; ``query_start_loc`` ``[num_reqs + 1]``; ``prompt_lens``
    ``[num_reqs]``. Rows past ``query_start_loc[-1]`` (padding) are False.
    """
    num_tokens = positions.numel()
    token_ids = torch.arange(num_tokens, device=positions.device)
    req = torch.bucketize(token_ids, query_start_loc[1:].to(token_ids.dtype), right=True)
    valid = req < prompt_lens.numel()
    req = req.clamp(max=max(prompt_lens.numel() - 1, 0))
    return valid & upper_active(positions, prompt_lens.to(positions.dtype)[req], anchor_tokens)


def select_upper_rows(positions: torch.Tensor, query_start_loc: torch.Tensor,
                      prompt_lens: torch.Tensor, anchor_tokens: int) -> UpperRows:
    """The rows that run the upper layers and their per-request offsets.

    Uses ``nonzero`` (one host sync for the row count), like vLLM's own logits-index path.
    """
    mask = upper_row_mask(positions, query_start_loc, prompt_lens, anchor_tokens)
    rows = mask.nonzero().flatten()
    qsl = torch.zeros_like(query_start_loc)
    if mask.numel():
        # Offset after request r = number of upper rows before its end.
        before = torch.cumsum(mask.to(query_start_loc.dtype), 0)
        ends = query_start_loc[1:]
        qsl[1:] = before[(ends - 1).clamp(min=0)] * (ends > 0)
    return UpperRows(rows=rows, query_start_loc=qsl)
