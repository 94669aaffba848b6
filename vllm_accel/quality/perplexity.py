"""Perplexity on held-out prose, from the engine's prompt log-probabilities.

Windows of ``window`` tokens are cut from the held-out essays (never used as haystack); the
engine returns the log-probability of every prompt token given its prefix; perplexity is
``exp(-mean)`` over all predicted tokens of all windows (the first token of a window has no
prediction and is skipped).
"""

from __future__ import annotations

import math

from vllm_accel.quality import data


def build_windows(tokenizer, window: int, count: int) -> list[list[int]]:
    ids = tokenizer(data.heldout_text(), add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    step = window - len(bos)
    if step * count > len(ids):
        raise ValueError(f"held-out text has {len(ids)} tokens; {count}x{step} requested")
    return [bos + ids[i * step : (i + 1) * step] for i in range(count)]


def perplexity(logprobs_per_window: list[list[float | None]]) -> float:
    values = [lp for window in logprobs_per_window for lp in window if lp is not None]
    if not values:
        raise ValueError("no log-probabilities to score")
    return math.exp(-sum(values) / len(values))
