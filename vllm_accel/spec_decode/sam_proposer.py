"""SAMProposer: model-free drafts from suffix automata (SAM-Decoding style), for vLLM.

Use it through vLLM's ``custom_class`` method::

    --speculative-config '{"method": "custom_class",
                           "model": "vllm_accel.spec_decode.SAMProposer",
                           "num_speculative_tokens": 8}'
    --additional-config '{"vllm_accel": {"spec_decode": {"min_match": 3}}}'   # optional

Each step, for every request that just sampled a token:

1. the request's own automaton (prompt + everything generated so far, keyed by request id)
   is extended with the tokens added since the last step: amortised O(1) per token;
2. if a datastore is configured, the request's matcher over the shared, read-only corpus
   automaton is fed the same tokens;
3. the source with the longer suffix match drafts: nothing below ``min_match`` tokens, and
   ``ceil(match * length_factor)`` tokens above it (capped by the number of speculative tokens
   the scheduler asked for and by the model length). A long exact match (code being rewritten,
   a passage being quoted) earns a long draft; a short, probably accidental one a short draft.

Drafts are verified by the target model like any other, so greedy output is unchanged.

The per-request state needs request ids, which vLLM 0.32 only passes to ``custom_class``
proposers through vllm_accel's ``proposer_input_batch`` runtime patch (applied when this class
is built, inside the model runner; upstream twin in ``patches/``). Without it vLLM calls
:meth:`SAMProposer.propose`, which drafts nothing and says so once.

A failure inside the proposer never fails a request: the step gets no drafts, the traceback is
logged once, and the per-request state is rebuilt from the batch on the next step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm_accel import faults
from vllm_accel.config import load_section
from vllm_accel.log import get_logger
from vllm_accel.spec_decode import datastore as datastore_mod
from vllm_accel.spec_decode.failsafe import LogOnce, drafts_or_none, drafts_without_batch
from vllm_accel.spec_decode.knobs import SpecDecodeKnobs
from vllm_accel.spec_decode.suffix_automaton import SuffixAutomaton, SuffixAutomatonMatcher

logger = get_logger("spec_decode")

#: num_speculative_tokens SAMProposer accepts. Past 16 a CPU or GPU verification step costs
#: more than the rare extra accepted token gives back.
MAX_SPECULATIVE_TOKENS = 16
_CLASS_PATH = "vllm_accel.spec_decode.SAMProposer"


@dataclass
class _RequestState:
    """What SAMProposer knows about one request."""

    automaton: SuffixAutomaton
    corpus: SuffixAutomatonMatcher | None
    num_prompt_tokens: int
    num_fed: int = 0  # tokens of the request's sequence already in the automaton
    last_token: int = -1  # the token at position num_fed - 1, to detect a reused request id

    def continues(self, row: Any, num_tokens: int, num_prompt_tokens: int) -> bool:
        """Whether ``row[:num_tokens]`` extends the sequence this state was built from."""
        return (num_prompt_tokens == self.num_prompt_tokens and num_tokens >= self.num_fed
                and (self.num_fed == 0 or int(row[self.num_fed - 1]) == self.last_token))


class SAMProposer:
    """Speculative proposer over a per-request suffix automaton and an optional corpus."""

    def __init__(self, vllm_config: Any) -> None:
        spec_config = vllm_config.speculative_config
        k = spec_config.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--speculative-config num_speculative_tokens={k}: {_CLASS_PATH} drafts 1 to "
                f"{MAX_SPECULATIVE_TOKENS} tokens; set num_speculative_tokens in that range "
                f"(8 is a good start)")
        self.num_speculative_tokens: int = k
        self.knobs: SpecDecodeKnobs = load_section("spec_decode", vllm_config.additional_config)
        self.max_model_len: int = vllm_config.model_config.max_model_len
        self.corpus: SuffixAutomaton | None = None
        if self.knobs.datastore is not None:
            self.corpus = datastore_mod.load(
                self.knobs.datastore, _model_tokenizer_identity(vllm_config.model_config))
            logger.info("SAMProposer: datastore %s (%d tokens, %d states)",
                        self.knobs.datastore, self.corpus.num_tokens, self.corpus.num_states)
        self._requests: dict[str, _RequestState] = {}
        self._once = LogOnce()
        self.batch_api_enabled = _enable_batch_api()
        logger.info("SAMProposer: num_speculative_tokens=%d, %s", k, self.knobs)

    # ------------------------------------------------------------------ vLLM hooks

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's runners call this on every drafter; SAMProposer has no model."""

    def propose(self, sampled_token_ids: list[list[int]], *args: Any, **kwargs: Any
                ) -> list[list[int]]:
        """vLLM's plain ``custom_class`` call, without request ids: no drafts (see the module
        docstring); logged once."""
        return drafts_without_batch("SAMProposer", self._once, len(sampled_token_ids))

    def propose_with_batch(self, num_speculative_tokens: int, input_batch: Any,
                           sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """Drafts for every row of ``input_batch`` (``[]`` for rows that sampled nothing)."""
        return drafts_or_none(
            "SAMProposer", self._once, len(sampled_token_ids),
            lambda: self._propose(num_speculative_tokens, input_batch, sampled_token_ids),
            on_error=self._requests.clear)  # rebuilt from the batch next step

    # ------------------------------------------------------------------ drafting

    def _propose(self, num_speculative_tokens: int, input_batch: Any,
                 sampled_token_ids: list[list[int]]) -> list[list[int]]:
        faults.maybe_inject("proposer")
        k = min(num_speculative_tokens, self.num_speculative_tokens)
        req_ids = input_batch.req_ids
        num_tokens_no_spec = input_batch.num_tokens_no_spec
        num_prompt_tokens = input_batch.num_prompt_tokens
        token_ids = input_batch.token_ids_cpu
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled or k <= 0:  # a partial prefill, or no drafting this step
                drafts.append([])
                continue
            num_tokens = int(num_tokens_no_spec[row])
            state = self._update(req_ids[row], token_ids[row], num_tokens,
                                 int(num_prompt_tokens[row]))
            budget = min(k, self.max_model_len - num_tokens - 1)
            drafts.append(self._draft(state, budget) if budget > 0 else [])
        self._forget_finished(input_batch.req_id_to_index)
        return drafts

    def _update(self, req_id: str, row: Any, num_tokens: int,
                num_prompt_tokens: int) -> _RequestState:
        """The request's state, extended to ``row[:num_tokens]`` (new if unknown or reused)."""
        state = self._requests.get(req_id)
        if state is None or not state.continues(row, num_tokens, num_prompt_tokens):
            state = _RequestState(
                automaton=SuffixAutomaton(self.knobs.max_states, "rebuild"),
                corpus=None if self.corpus is None else SuffixAutomatonMatcher(self.corpus),
                num_prompt_tokens=num_prompt_tokens)
            self._requests[req_id] = state
        if num_tokens > state.num_fed:
            new = row[state.num_fed:num_tokens]
            state.automaton.extend(new)
            if state.corpus is not None:
                state.corpus.feed(new)
            state.num_fed = num_tokens
            state.last_token = int(row[num_tokens - 1])
        return state

    def _draft(self, state: _RequestState, budget: int) -> list[int]:
        knobs = self.knobs
        own = state.automaton.match_len
        corpus = state.corpus.match_len if state.corpus is not None else 0
        sources = [(own, state.automaton, knobs.strategy)]
        if corpus:
            entry = (corpus, state.corpus, knobs.corpus_strategy)
            sources.insert(0 if corpus > own else 1, entry)
        for match_len, source, strategy in sources:
            if match_len < knobs.min_match:
                break  # sorted longest first: the rest match even less
            length = min(budget, math.ceil(match_len * knobs.length_factor))
            draft = source.draft(length, knobs.min_match, strategy)
            if draft:
                return draft
        return []

    def _forget_finished(self, req_id_to_index: dict[str, int]) -> None:
        """Drop the state of requests that left the batch (finished, aborted, preempted: a
        request that comes back is rebuilt from its tokens)."""
        gone = [req_id for req_id in self._requests if req_id not in req_id_to_index]
        for req_id in gone:
            del self._requests[req_id]


def _model_tokenizer_identity(model_config: Any) -> datastore_mod.TokenizerIdentity:
    tokenizer = datastore_mod.load_tokenizer(model_config.tokenizer,
                                             model_config.tokenizer_revision,
                                             model_config.trust_remote_code)
    return datastore_mod.tokenizer_identity(tokenizer)


def _enable_batch_api() -> bool:
    """Apply the proposer_input_batch runtime patch (and the CPU sampling fix) in this
    (model-runner) process."""
    from vllm_accel.spec_decode.runtime_patches import apply_sampling_fix

    apply_sampling_fix("SAMProposer")
    try:
        import vllm

        from vllm_accel._patches import proposer_input_batch
        from vllm_accel.patching import apply

        apply(proposer_input_batch.PATCH, vllm.__version__)
        return True
    except Exception as exc:  # a conflicting plugin, an unsupported vLLM: run without drafts
        logger.error("SAMProposer: cannot enable per-request drafting (%s); it will draft "
                     "nothing", exc)
        return False
