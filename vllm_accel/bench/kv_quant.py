"""The ``kv-quant`` benchmark: a quantized ``--kv-cache-dtype`` against vLLM's bf16 cache.

``vllm-accel bench kv-quant [--quick]`` (definition: ``features.FEATURES``) runs one engine per
side with the same model dtype and the **same KV-cache bytes** (``kv_cache_memory_bytes``), so
the number of KV blocks vLLM allocates on each side is its capacity in tokens by vLLM's own
block accounting (the page bytes come from the backend's ``customize_spec``):

* ``baseline``: ``--kv-cache-dtype auto`` (bf16 pages);
* ``accelerated``: ``--kv-cache-dtype kivi_4bit``, or the dtype given to
  ``bench kv-quant --kv-cache-dtype kivi_2bit``.

``ratios.kv_capacity_ratio`` = accelerated / baseline tokens; ``ratios.kv_bytes_per_token_*``
are the KV bytes per token (all layers) each side's cache costs. Quality (``quality.ppl_bf16``,
``quality.ppl_quant``, needle/retrieval, top-1 agreement with the bf16 side) comes from the
common tasks.
"""

from __future__ import annotations

from typing import Any

DEFAULT_DTYPE = "kivi_4bit"
MODEL_DTYPE = "bfloat16"  # the KIVI backends store a 16-bit residual: 16-bit models only
KV_CACHE_BYTES = 1 << 30


def engine_extra(kv_cache_dtype: str) -> dict[str, Any]:
    """Engine settings of one side: the cache dtype, a bf16 model, a fixed KV-cache size."""
    return {"kv_cache_dtype": kv_cache_dtype, "dtype": MODEL_DTYPE,
            "kv_cache_memory_bytes": KV_CACHE_BYTES}


def _tokens(side: dict[str, Any]) -> int:
    return int(side["num_kv_blocks"]) * int(side["block_size"])


def report(baseline: dict[str, Any], accelerated: dict[str, Any]
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kv_capacity_ratio`` and bytes per token from each side's blocks; ppl under the names
    the KV-quantization literature uses."""
    base_tokens, quant_tokens = _tokens(baseline), _tokens(accelerated)
    ratios = {
        "kv_capacity_ratio": quant_tokens / base_tokens,
        "kv_tokens_baseline": base_tokens,
        "kv_tokens_quant": quant_tokens,
        "kv_bytes_per_token_baseline":
            baseline["engine"]["kv_cache_memory_bytes"] / base_tokens,
        "kv_bytes_per_token_quant":
            accelerated["engine"]["kv_cache_memory_bytes"] / quant_tokens,
    }
    quality = {"ppl_bf16": baseline.get("perplexity"), "ppl_quant": accelerated.get("perplexity")}
    return ratios, quality
