"""Show ``custom_class`` speculative proposers the target model's logits of each step.

Token recycling (``vllm_accel.spec_decode.RecyclingProposer``) learns each token's likely
successors from the target's own next-token logits. In vLLM 0.32 those logits exist only
inside ``GPUModelRunner.sample_tokens`` (vllm/v1/worker/gpu_model_runner.py:4304; the CPU
runner inherits it), which hands them to ``_sample`` (l.3437) and drops them; the drafter,
called later, never sees them.

The patch wraps ``_sample``: when the drafter defines ``observe_target_logits``, it first calls
``drafter.observe_target_logits(token_ids, logits)``, where ``logits`` are the rows computed
this step (one per sampled position and per verified draft token, as given to the sampler,
before temperature or penalties) and ``token_ids[i]`` is the input token at row ``i``'s
position (``input_ids[spec_decode_metadata.logits_indices]``: the row's logits predict what
follows that token). Nothing else changes: other drafters, steps without speculative-decoding
metadata, and the sampling itself go through the original untouched. Upstream twin:
``patches/0007-spec-decode-proposer-target-logits.patch``.
"""

from __future__ import annotations

from typing import Any

from vllm_accel.patching import RuntimePatch


def _make_replacement(original: Any) -> Any:
    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        observe = getattr(getattr(self, "drafter", None), "observe_target_logits", None)
        if observe is not None and logits is not None and spec_decode_metadata is not None:
            observe(self.input_ids.gpu[spec_decode_metadata.logits_indices], logits)
        return original(self, logits, spec_decode_metadata, *args, **kwargs)

    return _sample


PATCH = RuntimePatch(
    name="proposer_target_logits",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
    vllm_versions=("0.32.0",),
    upstream_diff="0007-spec-decode-proposer-target-logits.patch",
    reason="custom_class proposers never see the target's logits (token recycling needs them)",
    make_replacement=_make_replacement,
)
