"""Process-wide fault counters, and fault injection for the fault run.

A feature that degrades instead of failing (a proposer that raised, so the step got no drafts)
calls :func:`record`. The counts reach vLLM's Prometheus ``/metrics`` as :data:`PROM_COUNTERS`
through the chunk-reuse connector's per-step stats (vLLM 0.32's only channel from the worker
to the API server's metrics; with no connector they are in the log only, where each feature
logs its first failure with the traceback).

Fault injection (failpoints): ``VLLM_ACCEL_INJECT_FAULTS="proposer=0.05"`` makes
:func:`maybe_inject` raise :class:`InjectedFault` at that point with that probability, so a
running server can be shown to survive the fault (``vllm-accel fault-run`` sets it). Points:
``proposer`` (inside every vllm_accel proposer's drafting). Unset: never raises, one dict
lookup.
"""

from __future__ import annotations

import os
import random
import threading
from collections import defaultdict

ENV = "VLLM_ACCEL_INJECT_FAULTS"
POINTS = ("proposer",)
#: Prometheus counter name -> (counter key, help text).
PROM_COUNTERS = {
    "vllm:accel_proposer_errors": ("proposer_errors",
                                   "Proposer failures; those steps got no drafts (outputs "
                                   "are unaffected)"),
}


class InjectedFault(RuntimeError):
    """Raised by :func:`maybe_inject` where ``VLLM_ACCEL_INJECT_FAULTS`` asks for it."""


def parse_rates(text: str) -> dict[str, float]:
    """``"proposer=0.05"`` -> ``{"proposer": 0.05}``; a clear error for anything else."""
    rates = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        point, sep, value = item.partition("=")
        if not sep or point not in POINTS:
            raise ValueError(f"{ENV}={text!r}: expected POINT=PROBABILITY[,...] with POINT one "
                             f"of {', '.join(POINTS)}")
        rate = float(value)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"{ENV}: {point}={value} must be a probability in [0, 1]")
        rates[point] = rate
    return rates


_rates = parse_rates(os.environ.get(ENV, ""))
_lock = threading.Lock()
_counts: dict[str, float] = defaultdict(float)
_taken: dict[str, float] = {}


def maybe_inject(point: str) -> None:
    rate = _rates.get(point)
    if rate and random.random() < rate:
        raise InjectedFault(f"fault injected at {point!r} ({ENV})")


def record(key: str, amount: float = 1) -> None:
    with _lock:
        _counts[key] += amount


def totals() -> dict[str, float]:
    with _lock:
        return dict(_counts)


def take_increments() -> dict[str, float]:
    """Counts added since the last call (non-zero only)."""
    global _taken
    with _lock:
        now = dict(_counts)
    out = {k: v - _taken.get(k, 0.0) for k, v in now.items()}
    _taken = now
    return {k: v for k, v in out.items() if v}
