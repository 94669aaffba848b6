"""Give attention metadata builders each request's prompt length and id.

``GPUModelRunner._build_attention_metadata`` (vllm/v1/worker/gpu_model_runner.py:2249 in
0.32.0; the CPU runner inherits it) puts per-request prompt lengths into
``CommonAttentionMetadata.rswa_prefix_lens`` only when the model has an R-SWA window
(l.2387-2389), and never says which request a batch row is. SPEED (``--attention-backend
ACCEL_SPEED``) needs the prompt lengths for every model: its upper layers run only the anchors,
each request's last prompt token and the decode tokens. KIVI (``--kv-cache-dtype kivi_*``) keeps
each running request's unfinished key group in a pool entry of its own and needs the request of
each row, and the requests the runner still holds (``self.requests``: finished ones are gone,
preempted ones stay).

The patch: while the original builds the step's metadata, publish
``input_batch.num_prompt_tokens_cpu_tensor``, ``input_batch.req_ids`` and the keys of
``self.requests`` in :mod:`vllm_accel.attention.step_requests` (cleared afterwards). Nothing else
changes. Applied on demand in the worker process, by the SPEED model, by the KIVI builder and
by the chunk-reuse connector when it runs APE attention (which reads the row order in the
forward).
Upstream twin: ``patches/0008-attention-metadata-step-requests.patch`` (``num_prompt_tokens_cpu``,
``req_ids`` and ``live_req_ids`` fields of ``CommonAttentionMetadata``).
"""

from __future__ import annotations

from typing import Any

from vllm_accel.patching import RuntimePatch


def _make_replacement(original: Any) -> Any:
    from vllm_accel.attention.step_requests import StepRequests, publish

    def _build_attention_metadata(self, *args, **kwargs):
        batch = self.input_batch
        publish(StepRequests(prompt_lens=batch.num_prompt_tokens_cpu_tensor,
                             req_ids=batch.req_ids, live_req_ids=self.requests.keys()))
        try:
            return original(self, *args, **kwargs)
        finally:
            publish(None)

    return _build_attention_metadata


PATCH = RuntimePatch(
    name="attention_step_requests",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
    vllm_versions=("0.32.0",),
    upstream_diff="0008-attention-metadata-step-requests.patch",
    reason="attention builders get per-request prompt lengths only for R-SWA models, and no "
           "request ids",
    make_replacement=_make_replacement,
)


def enable() -> None:
    """Apply the patch in this process (a no-op when it is already active)."""
    import vllm

    from vllm_accel.patching import apply

    apply(PATCH, vllm.__version__)
