"""Per-request facts of the current engine step that vLLM 0.32 does not give attention builders.

* **Prompt lengths.** ``CommonAttentionMetadata`` carries them only for R-SWA models
  (``rswa_prefix_lens``). SPEED's upper layers need them for every model: a token runs them only
  if it is an anchor, the last prompt token or a decode token.
* **Request ids.** Builders see batch rows, not requests, and rows move between steps. KIVI's
  residual pool (``--kv-cache-dtype kivi_*``) keeps one entry per running request and must know
  which request each row is, and which requests the runner still holds (running or preempted):
  the others' entries are free. The chunk-reuse connector's APE attention
  (``kv_connector/ape.py``) needs the request of each row in the forward, after the metadata
  was built.

The runtime patch ``vllm_accel._patches.attention_step_requests`` publishes them here while the
runner builds the step's attention metadata; builders read them with :func:`prompt_lens`,
:func:`row_req_ids` and :func:`live_req_ids`; attention layers in the forward that follows read
:func:`forward_req_ids`. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

PATCH_NAME = "vllm_accel._patches.attention_step_requests"


@dataclass(frozen=True)
class StepRequests:
    prompt_lens: torch.Tensor  # CPU int, one entry per batch row
    req_ids: Sequence[str | None]  # request id of each batch row (None: empty row)
    live_req_ids: Collection[str]  # every request the runner holds state for


_current: dict[str, StepRequests | None] = {"step": None}
_forward_rows: list[list[str | None]] = [[]]


def publish(step: StepRequests | None) -> None:
    """Set the step's requests, or clear them (None) once its metadata is built. The row
    order of the last published step stays readable for the forward (:func:`forward_req_ids`)."""
    _current["step"] = step
    if step is not None:
        _forward_rows[0] = list(step.req_ids)  # the runner reorders its list in place


def _step() -> StepRequests:
    step = _current["step"]
    if step is None:
        raise RuntimeError(
            "per-request facts were not published for this step: the runtime patch "
            f"{PATCH_NAME} is not applied in this process")
    return step


def prompt_lens(num_reqs: int) -> torch.Tensor:
    """The prompt length of batch rows ``0 .. num_reqs-1`` (int64, CPU).

    Raises if nothing was published: the runtime patch is not applied, and guessing would
    change the model's output silently.
    """
    return _step().prompt_lens[:num_reqs].to(torch.long)


def row_req_ids(num_reqs: int) -> list[str | None]:
    """The request id of batch rows ``0 .. num_reqs-1`` (None for a row without a request, as
    in vLLM's dummy and profiling runs)."""
    ids = list(_step().req_ids[:num_reqs])
    return ids + [None] * (num_reqs - len(ids))


def live_req_ids() -> Collection[str]:
    """Requests the model runner still holds (scheduled, unscheduled or preempted, not
    finished): state kept for any other request can be dropped."""
    return _step().live_req_ids


def forward_req_ids(num_reqs: int) -> list[str | None]:
    """The request id of batch rows ``0 .. num_reqs-1`` of the batch whose attention metadata
    was built last: in the forward of that step, the rows attention layers see (None where
    unknown)."""
    ids = _forward_rows[0][:num_reqs]
    return ids + [None] * (num_reqs - len(ids))
