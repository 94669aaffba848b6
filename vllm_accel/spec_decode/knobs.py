"""The ``spec_decode`` knobs of the model-free proposers.

Set them with ``--additional-config '{"vllm_accel": {"spec_decode": {"min_match": 4}}}'`` or per
knob with environment variables (``VLLM_ACCEL_SPEC_DECODE_MIN_MATCH=4``). This module does not
import vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_accel.config import register_section

STRATEGIES = ("recent", "first", "frequent")
#: The smallest per-request automaton bound accepted (states).
MIN_MAX_STATES = 1024


@register_section("spec_decode")
@dataclass(frozen=True)
class SpecDecodeKnobs:
    #: No draft unless the longest suffix match (in tokens) is at least this long. Shorter
    #: matches are mostly coincidence on open-ended text and their drafts get rejected, which
    #: costs verification time for nothing. Defaults (min_match=3, length_factor=2.0) chosen by
    #: replaying the benchmark's greedy outputs (Qwen2.5-Coder-0.5B: code editing, RAG, agent
    #: turns, open chat) through the proposer with a step cost measured on a 2-core CPU
    #: (fp32, ~1k context: +2 draft tokens ~free, each further token +8.5 %): among the
    #: settings within a few % of the fastest, the one whose mean accepted length beats vLLM's
    #: ngram on every workload. min_match=2 drafts more and is ~5 % faster on RAG but accepts
    #: fewer tokens per draft; 4 loses 10-20 % on RAG.
    min_match: int = 3
    #: How the per-request automaton picks a continuation: "recent" (copy what followed the
    #: latest earlier occurrence: the last version of edited code), "first" or "frequent"
    #: (O(states) per step on a growing automaton: slow on long requests).
    strategy: str = "recent"
    #: How the corpus (datastore) automaton picks a continuation; "frequent" is free on it.
    corpus_strategy: str = "frequent"
    #: Draft length per matched token: a match of m tokens drafts up to ceil(m * factor)
    #: tokens (capped by num_speculative_tokens). Longer matches earn longer drafts.
    length_factor: float = 2.0
    #: Path of a datastore built with ``vllm-accel datastore build`` (None: no corpus).
    datastore: str | None = None
    #: Most states one request's automaton may hold (about 90 bytes each); past it, the
    #: automaton is rebuilt from the request's most recent max_states // 4 tokens.
    max_states: int = 131072

    def validate(self) -> dict[str, str]:
        problems = {}
        if self.min_match < 1:
            problems["min_match"] = "must be >= 1 (tokens)"
        if self.strategy not in STRATEGIES:
            problems["strategy"] = f"choose one of {', '.join(STRATEGIES)}"
        if self.corpus_strategy not in STRATEGIES:
            problems["corpus_strategy"] = f"choose one of {', '.join(STRATEGIES)}"
        if not self.length_factor > 0:
            problems["length_factor"] = "must be > 0"
        if self.datastore is not None and not self.datastore.strip():
            problems["datastore"] = "must be a file path (or leave it unset for no corpus)"
        if self.max_states < MIN_MAX_STATES:
            problems["max_states"] = f"must be >= {MIN_MAX_STATES}"
        return problems
