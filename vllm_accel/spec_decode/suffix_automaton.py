"""Suffix automata over token ids, for model-free speculative decoding.

Uses the native extension ``vllm_accel._C_sam`` (C++, ``csrc/suffix_automaton``)
when it was built and imports, else the pure-Python fallback ``_sam_python``
with the same API and identical results.  ``VLLM_ACCEL_SAM_FORCE_PYTHON=1``
forces the fallback.  This module does not import vLLM.

API (both implementations)::

    sam = SuffixAutomaton(max_states=None, on_full="rebuild")
    sam.extend(tokens)            # iterable of ints or 1-D int array; O(1) amortised/token
    sam.match_len                 # longest suffix of everything appended that occurred
                                  # earlier with a following token (0 = none)
    sam.match_end                 # end position (in sam.tokens()) "recent" copies from
    sam.draft(k, min_match=1, strategy="recent", min_prob=0.0) -> list[int]
    sam.count(pattern) -> int     # occurrences of pattern in sam.tokens()
    sam.freeze()                  # read-only from now on; extend() only moves the match
    sam.save(path); SuffixAutomaton.load(path)   # loaded automata are frozen
    m = sam.matcher()             # == SuffixAutomatonMatcher(sam); needs a frozen sam
    m.feed(tokens); m.match_len; m.match_end; m.draft(...); m.reset()
    # read-only: frozen, num_states, num_transitions, num_tokens, total_tokens,
    # num_rebuilds, max_states, on_full; tokens(), memory_bytes()

Draft strategies:

* ``"recent"`` (default): copy the k tokens that followed a recent earlier
  occurrence of the match (the occurrence recorded the last time this match
  state was reached).  Generation mostly repeats its *latest* context (the last
  version of edited code, the current loop), it costs O(k), and it needs no
  occurrence counts, so it suits the per-request automaton that grows every step.
* ``"first"``: copy after the earliest occurrence (exact, O(k)).
* ``"frequent"``: from the match, repeatedly take the next token with the most
  occurrences (ties: smaller id), stopping when the product of conditional
  frequencies falls below ``min_prob``.  Needs occurrence counts: free on a
  frozen automaton (computed once by freeze()/load()), but O(states) after every
  extend() on a growing one, so use it for the static corpus automaton.

Memory bound: with ``max_states`` set, the automaton never holds more than
``max_states`` states (at most 3x as many transitions, and at most as many text
tokens).  When one more token could exceed it, ``on_full="rebuild"`` rebuilds
from the most recent ``max_states // 4`` tokens (amortised O(1) per token);
``on_full="freeze"`` stops growing and only tracks the match from then on.

Performance: the native extend() costs ~0.3 us/token in bulk and ~1 us for a
one-token call; draft() ~0.5 us.  Pass arguments positionally in hot loops
(``draft(k, min_match, strategy)``): pybind11's keyword path adds ~1-2 us/call.
Native extend() of >1024 tokens, save() and load() release the GIL, so never
use one automaton from two threads while it grows; a frozen automaton may be
shared by any number of matchers.

Errors: ``ValueError`` for bad arguments and out-of-int32 token ids,
``TypeError`` for non-integer tokens, ``OSError`` when a file cannot be opened,
``SAMFormatError`` (a ``ValueError``) for a corrupt or foreign file.
"""

from __future__ import annotations

import os
from types import ModuleType

from vllm_accel.spec_decode import _sam_python

FORCE_PYTHON_ENV = "VLLM_ACCEL_SAM_FORCE_PYTHON"


def _import_native() -> tuple[ModuleType | None, str | None]:
    try:
        from vllm_accel import _C_sam
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return _C_sam, None


_native, _native_error = _import_native()
_forced = os.environ.get(FORCE_PYTHON_ENV, "") == "1"

#: True when SuffixAutomaton below is the native (C++) class.
NATIVE_AVAILABLE: bool = _native is not None and not _forced
#: "native" or "python".
IMPLEMENTATION: str = "native" if NATIVE_AVAILABLE else "python"
#: Why the native extension is not used (None when it is).
NATIVE_UNAVAILABLE_REASON: str | None = (
    None if NATIVE_AVAILABLE else (f"{FORCE_PYTHON_ENV}=1" if _forced else _native_error)
)

_impl: ModuleType = _native if NATIVE_AVAILABLE else _sam_python
SuffixAutomaton = _impl.SuffixAutomaton
SuffixAutomatonMatcher = _impl.SuffixAutomatonMatcher
SAMFormatError = _impl.SAMFormatError


def available_implementations() -> dict[str, ModuleType]:
    """Every importable implementation, ignoring the force-Python variable
    (for tests and benchmarks): {"python": ..., "native": ...}."""
    impls = {"python": _sam_python}
    if _native is not None:
        impls["native"] = _native
    return impls


__all__ = [
    "FORCE_PYTHON_ENV",
    "IMPLEMENTATION",
    "NATIVE_AVAILABLE",
    "NATIVE_UNAVAILABLE_REASON",
    "SAMFormatError",
    "SuffixAutomaton",
    "SuffixAutomatonMatcher",
    "available_implementations",
]
