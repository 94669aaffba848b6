"""Quantized KV cache: KIVI-style ``--kv-cache-dtype kivi_4bit`` / ``kivi_2bit`` (CPU).

* :mod:`vllm_accel.kv_quant.backend` -- the attention backends that own the page format
  (``ACCEL_KIVI_4BIT``, ``ACCEL_KIVI_2BIT``), selected automatically by the dtype.
* :mod:`vllm_accel.kv_quant.config` -- knobs (``--additional-config '{"vllm_accel":
  {"kv_quant": {...}}}'``).
* The page format and kernels are in :mod:`vllm_accel.kernels.kivi_format`,
  :mod:`~vllm_accel.kernels.kivi_cache` and :mod:`~vllm_accel.kernels.kivi_attention`; the vLLM
  patches that make the names valid in ``vllm_accel._patches.kv_cache_dtype_names``.
"""
