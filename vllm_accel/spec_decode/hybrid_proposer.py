"""HybridProposer: per request and per step, the draft source expected to pay off, or none.

Use it through vLLM's ``custom_class`` method::

    --speculative-config '{"method": "custom_class",
                           "model": "vllm_accel.spec_decode.HybridProposer",
                           "num_speculative_tokens": 8}'

Two sources draft every step for every request that sampled a token:

* ``sam`` — :class:`~vllm_accel.spec_decode.SAMProposer` (the request's own text and the
  optional corpus datastore): long, mostly right drafts where text is being copied;
* ``recycling`` — :class:`~vllm_accel.spec_decode.RecyclingProposer` (the target's own top-k
  successors of each token): short drafts that help a little almost anywhere.

The hybrid keeps, per request and per source, a running acceptance rate (accepted / drafted
tokens of that source's verified drafts, learned from how many tokens each step sampled after
a draft) and picks the draft with the longest expected accepted length, ``rate * length``,
among the sources whose rate beats ``hybrid_verify_cost`` (the cost of verifying one draft
token, as a fraction of a decode step). When no source beats it, the request gets no draft:
on open chat, where both sources mostly miss, decoding then runs as without speculation,
except for a short probe draft every ``hybrid_probe_every`` steps that lets a source's rate
recover when the text turns repetitive. A new request starts from the rates of all requests
so far.

Needs the ``proposer_input_batch`` runtime patch (request ids) and ``proposer_target_logits``
(the target's logits), both applied when the class is built. A failure inside the proposer
never fails a request: the step gets no drafts, the traceback is logged once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from vllm_accel import faults
from vllm_accel.log import get_logger
from vllm_accel.spec_decode.acceptance import Candidate, SourceRates, choose
from vllm_accel.spec_decode.failsafe import LogOnce, drafts_or_none, drafts_without_batch
from vllm_accel.spec_decode.recycling_proposer import RecyclingProposer
from vllm_accel.spec_decode.sam_proposer import SAMProposer

logger = get_logger("spec_decode")

SOURCES = ("sam", "recycling")
#: Starting acceptance rates before anything was verified. SAM only drafts on an exact suffix
#: match of ``min_match`` tokens or more, which usually continues; a recycled chain is a
#: guess, but one above any sensible verify cost so that it gets tried.
PRIOR_RATES = {"sam": 0.6, "recycling": 0.3}
#: Tokens a probe draft may have.
PROBE_LEN = 2


@dataclass
class _RequestState:
    rates: SourceRates
    #: The source and length of the draft proposed last step (verified this step).
    pending: tuple[str, int] | None = None
    #: Steps since each source last drafted for this request (this one included).
    idle: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))


class HybridProposer:
    """Chooses per request and step between SAMProposer and RecyclingProposer drafts."""

    def __init__(self, vllm_config: Any) -> None:
        self.sam = SAMProposer(vllm_config)
        self.recycling = RecyclingProposer(vllm_config)
        self.knobs = self.sam.knobs
        self.rates = SourceRates(self.knobs.hybrid_ema_weight, dict(PRIOR_RATES))
        self._requests: dict[str, _RequestState] = {}
        self._once = LogOnce()
        #: Drafts chosen per source, and steps with no draft (for logs and tests).
        self.counts: dict[str, int] = dict.fromkeys((*SOURCES, "none"), 0)
        logger.info("HybridProposer: verify_cost=%.3f, ema_weight=%.2f, probe_every=%d",
                    self.knobs.hybrid_verify_cost, self.knobs.hybrid_ema_weight,
                    self.knobs.hybrid_probe_every)

    # ------------------------------------------------------------------ vLLM hooks

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's runners call this on every drafter; HybridProposer has no model."""

    def observe_target_logits(self, token_ids: Any, logits: Any) -> None:
        self.recycling.observe_target_logits(token_ids, logits)

    def propose(self, sampled_token_ids: list[list[int]], *args: Any, **kwargs: Any
                ) -> list[list[int]]:
        """vLLM's plain ``custom_class`` call, without request ids: no drafts; logged once."""
        return drafts_without_batch("HybridProposer", self._once, len(sampled_token_ids))

    def propose_with_batch(self, num_speculative_tokens: int, input_batch: Any,
                           sampled_token_ids: list[list[int]]) -> list[list[int]]:
        return drafts_or_none(
            "HybridProposer", self._once, len(sampled_token_ids),
            lambda: self._propose(num_speculative_tokens, input_batch, sampled_token_ids),
            on_error=self._requests.clear)

    # ------------------------------------------------------------------ choosing

    def _propose(self, num_speculative_tokens: int, input_batch: Any,
                 sampled_token_ids: list[list[int]]) -> list[list[int]]:
        faults.maybe_inject("proposer")
        by_source = {
            "sam": self.sam.propose_with_batch(num_speculative_tokens, input_batch,
                                               sampled_token_ids),
            "recycling": self.recycling.propose_rows(num_speculative_tokens, sampled_token_ids,
                                                     input_batch.num_tokens_no_spec),
        }
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:  # a partial prefill: nothing verified, nothing to draft
                drafts.append([])
                continue
            state = self._state(input_batch.req_ids[row])
            self._learn(state, accepted=len(sampled) - 1)
            candidates = [Candidate(s, by_source[s][row]) for s in SOURCES]
            chosen = self.choose(state, candidates)
            drafts.append(chosen.draft if chosen is not None else [])
        self._forget_finished(input_batch.req_id_to_index)
        return drafts

    def choose(self, state: _RequestState, candidates: list[Candidate]) -> Candidate | None:
        """The draft for one request this step (None: no draft), and its bookkeeping."""
        for source in state.idle:
            state.idle[source] += 1
        probe = {s for s, idle in state.idle.items() if idle >= self.knobs.hybrid_probe_every}
        chosen = choose(candidates, state.rates, self.knobs.hybrid_verify_cost, probe,
                        PROBE_LEN)
        if chosen is None:
            state.pending = None
            self.counts["none"] += 1
            return None
        state.idle[chosen.source] = 0
        state.pending = (chosen.source, len(chosen.draft))
        self.counts[chosen.source] += 1
        return chosen

    def _learn(self, state: _RequestState, accepted: int) -> None:
        """Credit last step's draft of this request with the tokens accepted this step."""
        if state.pending is None:
            return
        source, drafted = state.pending
        state.pending = None
        state.rates.observe(source, drafted, accepted)
        self.rates.observe(source, drafted, accepted)

    def _state(self, req_id: str) -> _RequestState:
        state = self._requests.get(req_id)
        if state is None:  # a new request starts from what all requests taught so far
            state = _RequestState(rates=copy.deepcopy(self.rates))
            self._requests[req_id] = state
        return state

    def _forget_finished(self, req_id_to_index: dict[str, int]) -> None:
        for req_id in [r for r in self._requests if r not in req_id_to_index]:
            del self._requests[req_id]
