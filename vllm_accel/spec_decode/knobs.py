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
#: Widest recycling table row accepted (successors per token).
MAX_RECYCLING_TOPK = 64
#: Longest draft any proposer makes (the proposers' num_speculative_tokens bound).
MAX_DRAFT = 16


@register_section("spec_decode")
@dataclass(frozen=True)
class SpecDecodeKnobs:
    #: No draft unless the longest suffix match (in tokens) is at least this long. Shorter
    #: matches are mostly coincidence on open-ended text and their drafts get rejected, which
    #: costs verification time for nothing.
    #:
    #: The defaults (min_match=2, length_factor=3.0, strategy="first") were chosen by replaying
    #: the spec-decode benchmark's greedy outputs (Qwen2.5-Coder-0.5B; code editing, RAG, agent
    #: turns, open chat; two prompt sets) through the proposer, with the acceptance the replay
    #: predicts (it reproduces vLLM's counts exactly) and a step cost measured on the 2-core CPU
    #: (fp32, ~1k context: a step verifying d draft tokens costs 1 + 0.05 + 0.1 * (d - 2) plain
    #: steps). They were the fastest setting whose mean accepted length is never below vLLM's
    #: ngram (prompt_lookup 2..4): with min_match=2 SAM drafts wherever ngram does, but from
    #: the longest match, not a 4-gram. min_match=3 accepts more per draft but drafts less:
    #: 5-15 % slower on RAG; "recent" wins on one RAG prompt set and loses 20 % of the
    #: accepted length on the other.
    min_match: int = 2
    #: How the per-request automaton picks a continuation: "first" (copy what followed the
    #: earliest occurrence of the match: usually the source being quoted or rewritten),
    #: "recent" (the latest occurrence: better when the context holds several versions of the
    #: text being edited), or "frequent" (O(states) per step on a growing automaton).
    strategy: str = "first"
    #: How the corpus (datastore) automaton picks a continuation; "frequent" is free on it.
    corpus_strategy: str = "frequent"
    #: Draft length per matched token: a match of m tokens drafts up to ceil(m * factor)
    #: tokens (capped by num_speculative_tokens). Longer matches earn longer drafts: with
    #: K=16, a 2-token match drafts 6 tokens, 3 tokens 9, 5 or more 15-16.
    length_factor: float = 3.0
    #: Path of a datastore built with ``vllm-accel datastore build`` (None: no corpus).
    datastore: str | None = None
    #: Most states one request's automaton may hold (about 90 bytes each); past it, the
    #: automaton is rebuilt from the request's most recent max_states // 4 tokens.
    max_states: int = 131072

    # --- RecyclingProposer (token recycling) -------------------------------------------
    #: Successors kept per token in the recycling table (an int32 [vocab, k] array: 4.9 MB
    #: for a 152k vocabulary at k=8). Drafts follow the first column; the others are the
    #: target's runner-up candidates, kept for hot starts and tree drafts.
    recycling_topk: int = 8
    #: Longest chain RecyclingProposer drafts (also capped by num_speculative_tokens). A
    #: chain built from each token's most likely successor loses acceptance with every
    #: step, and on a CPU each verified token costs ~10 % of a decode step.
    recycling_max_draft: int = 4
    #: Hot start: a table file (``.npy``) written by an earlier run. Loaded at start-up when
    #: it exists (it must match the vocabulary and recycling_topk) and written back when the
    #: model runner's process exits. None: start empty, keep nothing.
    recycling_table: str | None = None

    # --- HybridProposer ---------------------------------------------------------------------
    #: What verifying one draft token costs, as a fraction of a plain decode step. A source
    #: drafts only while its expected accepted tokens per drafted token exceed this (and the
    #: source with the longest expected accepted length wins); below it, no draft: that is
    #: how the hybrid keeps open chat from slowing down. ~0.1 on a 2-core CPU, ~0.02 on a GPU.
    hybrid_verify_cost: float = 0.1
    #: Weight of the newest observation in each source's running acceptance rate
    #: (exponential moving average of accepted / drafted tokens, per request and global).
    hybrid_ema_weight: float = 0.3
    #: A source that is backed off still drafts (at most 2 tokens) once every this many
    #: steps of a request, so its acceptance rate can recover when the text turns repetitive.
    hybrid_probe_every: int = 16

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
        if not 1 <= self.recycling_topk <= MAX_RECYCLING_TOPK:
            problems["recycling_topk"] = f"must be between 1 and {MAX_RECYCLING_TOPK}"
        if not 1 <= self.recycling_max_draft <= MAX_DRAFT:
            problems["recycling_max_draft"] = f"must be between 1 and {MAX_DRAFT} (tokens)"
        if self.recycling_table is not None and not self.recycling_table.strip():
            problems["recycling_table"] = ("must be a file path (or leave it unset for no hot "
                                           "start)")
        if not 0.0 <= self.hybrid_verify_cost < 1.0:
            problems["hybrid_verify_cost"] = ("must be >= 0 and < 1 (a fraction of a decode "
                                              "step per verified draft token)")
        if not 0.0 < self.hybrid_ema_weight <= 1.0:
            problems["hybrid_ema_weight"] = "must be > 0 and <= 1"
        if self.hybrid_probe_every < 1:
            problems["hybrid_probe_every"] = "must be >= 1 (steps)"
        return problems
