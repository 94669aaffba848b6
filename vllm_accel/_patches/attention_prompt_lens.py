"""Give attention metadata builders every request's prompt length.

``GPUModelRunner._build_attention_metadata`` (vllm/v1/worker/gpu_model_runner.py:2249 in
0.32.0; the CPU runner inherits it) puts per-request prompt lengths into
``CommonAttentionMetadata.rswa_prefix_lens`` only when the model has an R-SWA window
(l.2387-2389). SPEED (``--attention-backend ACCEL_SPEED``) needs them for every model: its
upper layers run only the anchors, each request's last prompt token and the decode tokens.

The patch: while the original builds the step's metadata, publish
``input_batch.num_prompt_tokens_cpu_tensor`` in :mod:`vllm_accel.attention.step_requests`
(cleared afterwards). Nothing else changes. Applied on demand, by the SPEED model in the worker
process. Upstream twin: ``patches/0008-attention-metadata-prompt-lens.patch`` (always fill a
``num_prompt_tokens`` field of ``CommonAttentionMetadata``).
"""

from __future__ import annotations

from typing import Any

from vllm_accel.patching import RuntimePatch


def _make_replacement(original: Any) -> Any:
    from vllm_accel.attention.step_requests import publish_prompt_lens

    def _build_attention_metadata(self, *args, **kwargs):
        publish_prompt_lens(self.input_batch.num_prompt_tokens_cpu_tensor)
        try:
            return original(self, *args, **kwargs)
        finally:
            publish_prompt_lens(None)

    return _build_attention_metadata


PATCH = RuntimePatch(
    name="attention_prompt_lens",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
    vllm_versions=("0.32.0",),
    upstream_diff="0008-attention-metadata-prompt-lens.patch",
    reason="attention builders get per-request prompt lengths only for R-SWA models",
    make_replacement=_make_replacement,
)
