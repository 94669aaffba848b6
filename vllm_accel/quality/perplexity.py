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


def prediction_agreement(base: list[dict[str, list]], test: list[dict[str, list]]) -> dict:
    """How closely ``test``'s prompt predictions follow ``base``'s on the same windows.

    Each argument holds one ``{"logprobs": [...], "top1": [...]}`` per window (the engine
    worker's ``prompt_predictions`` task). Perplexity alone can mislead for a lossy KV cache: on
    text a model predicts badly (Qwen2.5-Coder-0.5B on the held-out essays, ppl ~80) noise
    flattens its over-confident predictions and *lowers* perplexity. These two numbers only grow
    with damage:

    * ``top1_agreement`` -- fraction of positions where both pick the same most likely token;
    * ``mean_abs_logprob_delta`` -- mean ``|log p_test(tok) - log p_base(tok)|`` of the prompt
      tokens (nats).
    """
    if len(base) != len(test):
        raise ValueError(f"{len(base)} base windows vs {len(test)} test windows")
    same = total = 0
    delta = 0.0
    for b, t in zip(base, test):
        if len(b["logprobs"]) != len(t["logprobs"]):
            raise ValueError("base and test windows differ in length")
        for lb, lt, tb, tt in zip(b["logprobs"], t["logprobs"], b["top1"], t["top1"]):
            if lb is None or lt is None:
                continue
            total += 1
            same += tb == tt
            delta += abs(lt - lb)
    if not total:
        raise ValueError("no predicted positions to compare")
    return {"top1_agreement": same / total, "mean_abs_logprob_delta": delta / total,
            "positions": total}
