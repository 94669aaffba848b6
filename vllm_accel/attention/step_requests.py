"""Per-request facts of the current engine step that vLLM 0.32 does not give attention builders.

``CommonAttentionMetadata`` carries each request's prompt length only for R-SWA models
(``rswa_prefix_lens``). SPEED's upper layers need it for every model: a token runs them only
if it is an anchor, the last prompt token or a decode token. The runtime patch
``vllm_accel._patches.attention_prompt_lens`` publishes the input batch's prompt lengths here
while the runner builds the step's attention metadata; builders read them with
:func:`prompt_lens`. No vLLM import.
"""

from __future__ import annotations

import torch

_current: dict[str, torch.Tensor | None] = {"prompt_lens": None}


def publish_prompt_lens(prompt_lens: torch.Tensor | None) -> None:
    """Set (a CPU int tensor, one entry per batch row) or clear (None) the step's prompt
    lengths."""
    _current["prompt_lens"] = prompt_lens


def prompt_lens(num_reqs: int) -> torch.Tensor:
    """The prompt length of batch rows ``0 .. num_reqs-1`` (int64, CPU).

    Raises if nothing was published: the runtime patch is not applied, and guessing would
    change the model's output silently.
    """
    lens = _current["prompt_lens"]
    if lens is None:
        raise RuntimeError(
            "per-request prompt lengths were not published for this step: the runtime patch "
            "vllm_accel._patches.attention_prompt_lens is not applied in this process")
    return lens[:num_reqs].to(torch.long)
