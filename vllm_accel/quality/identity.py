"""Greedy identity: do two runs produce the same tokens for the same prompts?"""

from __future__ import annotations


def compare(reference: list[list[int]], candidate: list[list[int]]) -> dict[str, float | int]:
    """Fraction of identical sequences and the earliest divergence (-1 if none)."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference vs {len(candidate)} candidate outputs")
    first_divergence = -1
    identical = 0
    for ref, cand in zip(reference, candidate):
        if ref == cand:
            identical += 1
            continue
        pos = next((i for i, (a, b) in enumerate(zip(ref, cand)) if a != b),
                   min(len(ref), len(cand)))
        first_divergence = pos if first_divergence < 0 else min(first_divergence, pos)
    return {"identical_fraction": identical / max(len(reference), 1),
            "first_divergence": first_divergence, "sequences": len(reference)}
