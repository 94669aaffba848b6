"""Give ``custom_class`` speculative proposers the runner's input batch.

``GPUModelRunner.propose_draft_token_ids`` (vllm/v1/worker/gpu_model_runner.py:4748 in 0.32.0;
the CPU runner inherits it) calls a ``custom_class`` drafter with condensed per-row arrays only:
no request ids and no prompt lengths, while rows are reordered and condensed as requests come
and go. A proposer that keeps per-request state (``vllm_accel.spec_decode.SAMProposer``: one
suffix automaton per request) cannot key it reliably.

The patch: when ``speculative_config.method == "custom_class"`` and the drafter defines
``propose_with_batch``, call ``drafter.propose_with_batch(num_spec_tokens_to_schedule,
self.input_batch, sampled_token_ids)`` (the call the built-in ``suffix`` method gets) and reset
the draft-probability fields the original resets first. Every other method and every drafter
without ``propose_with_batch`` goes to the original unchanged. Upstream twin:
``patches/0004-spec-decode-custom-proposer-input-batch.patch``.
"""

from __future__ import annotations

from typing import Any

from vllm_accel.patching import RuntimePatch


def _make_replacement(original: Any) -> Any:
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        spec_config = self.speculative_config
        propose_with_batch = getattr(self.drafter, "propose_with_batch", None)
        if (spec_config is None or spec_config.method != "custom_class"
                or propose_with_batch is None or not isinstance(sampled_token_ids, list)):
            return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        # What the original does before dispatching: no draft probabilities (model-free
        # drafts are verified as point masses).
        self._draft_probs = None
        self._draft_prob_req_ids = None
        return propose_with_batch(scheduler_output.num_spec_tokens_to_schedule,
                                  self.input_batch, sampled_token_ids)

    return propose_draft_token_ids


PATCH = RuntimePatch(
    name="proposer_input_batch",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
    vllm_versions=("0.32.0",),
    upstream_diff="0004-spec-decode-custom-proposer-input-batch.patch",
    reason="custom_class proposers get no request ids, so they cannot keep per-request state",
    make_replacement=_make_replacement,
)
