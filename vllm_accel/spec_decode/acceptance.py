"""Running acceptance statistics per draft source, for choosing (or skipping) a draft.

A source's *rate* is an exponential moving average of accepted / drafted tokens over its
verified drafts. Verifying ``n`` draft tokens costs about ``n * verify_cost`` plain decode
steps and yields ``rate * n`` extra tokens on average, so a draft pays for itself when
``rate > verify_cost``; among sources that pay, the one with the longest expected accepted
length (``rate * len(draft)``) wins.

Rates are kept per request (text that is being copied in one request says nothing about open
chat in another) and globally (the starting point of a new request's rates). This module has
no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SourceRates:
    """EMA acceptance rates of named sources; a source never observed has ``prior``."""

    weight: float
    prior: dict[str, float]
    rates: dict[str, float] = field(default_factory=dict)

    def rate(self, source: str) -> float:
        return self.rates.get(source, self.prior[source])

    def observe(self, source: str, drafted: int, accepted: int) -> None:
        """One verified draft of ``drafted`` tokens, ``accepted`` of them accepted."""
        if drafted <= 0:
            return
        sample = min(max(accepted, 0), drafted) / drafted
        self.rates[source] = (1 - self.weight) * self.rate(source) + self.weight * sample


@dataclass
class Candidate:
    source: str
    draft: list[int]


def choose(candidates: list[Candidate], rates: SourceRates, verify_cost: float,
           probe: set[str] | frozenset[str] = frozenset(), probe_len: int = 2
           ) -> Candidate | None:
    """The candidate with the longest expected accepted length among those whose rate beats
    ``verify_cost``; else a probe (the first non-empty candidate of a source in ``probe``,
    cut to ``probe_len`` tokens); else None (no draft this step)."""
    best, best_gain = None, 0.0
    for cand in candidates:
        r = rates.rate(cand.source)
        if cand.draft and r > verify_cost and r * len(cand.draft) > best_gain:
            best, best_gain = cand, r * len(cand.draft)
    if best is not None:
        return best
    for cand in candidates:
        if cand.draft and cand.source in probe:
            return Candidate(cand.source, cand.draft[:probe_len])
    return None
