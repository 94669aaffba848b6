"""``--attention-backend ACCEL_SPARSE_PREFILL``: block-sparse attention for long prefills.

Prefill chunks of requests whose context + chunk reach ``threshold`` tokens attend only to the
key blocks a cheap estimate ranks highest (XAttention-style antidiagonal scoring, cumulative
mass ``tau`` and/or a top-k budget, sink and local blocks always kept); shorter prefills, all
decodes and the layers in ``dense_layers`` run vLLM's own dense CPU attention kernel. Works with
batching, chunked prefill and prefix caching (query blocks are aligned to absolute positions,
so a chunk or a cache hit is scored against its whole context). CPU platform only in this
release; on CUDA it refuses to start with the reason.

Knobs: :mod:`.config` (``--additional-config '{"vllm_accel": {"sparse_prefill": {...}}}'``).
Roles: :mod:`.backend`. Plan step per layer: :mod:`.selection`. Time and density: :mod:`.stats`.
"""
