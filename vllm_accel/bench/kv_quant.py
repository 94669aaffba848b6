"""The ``kv-quant`` benchmark: a quantized ``--kv-cache-dtype`` against vLLM's bf16 cache.

``vllm-accel bench kv-quant [--quick]`` (definition: ``features.FEATURES``) runs one engine per
side with the same model dtype and the **same KV-cache bytes** (``kv_cache_memory_bytes``), so
the number of KV blocks vLLM allocates on each side is its capacity in tokens by vLLM's own
block accounting (the page bytes come from the backend's ``customize_spec``):

* ``baseline``: ``--kv-cache-dtype auto`` (pages in the model dtype: bf16, or the
  ``bench kv-quant --dtype``);
* ``accelerated``: ``--kv-cache-dtype kivi_4bit``, or the dtype given to
  ``bench kv-quant --kv-cache-dtype kivi_2bit``.

The KIVI residual pool (full-precision keys of each running request's unfinished key group, one
slot per ``--max-num-seqs``) lives outside vLLM's KV-cache budget: the accelerated side's
``kv_cache_memory_bytes`` is the budget **minus the pool** (:func:`finish_engine`), so both sides
use the same memory for KV. ``ratios.kv_capacity_ratio`` = accelerated / baseline tokens;
``ratios.kv_bytes_per_token_*`` are the KV bytes per token (all layers, pool included) each
side's cache costs; ``ratios.tail_pool_bytes`` the pool. ``ratios.prompt_buffer_bytes`` is the
most the exact prompt buffer holds (``kv_quant.prompt_exact_tokens``: unquantized K/V of a
prompt between its prefill steps, only while it is prefilled; not netted from the budget, like
the prefill's activations). Quality (``quality.ppl_bf16``, ``quality.ppl_quant``,
needle/retrieval, top-1 agreement with the bf16 side) comes from the common tasks. With
``--set extra_sides=true`` the quality tasks run once more on the KIVI side with the other
``value_rotation`` (:func:`other_value_rotation`; ``quality.*_value_rotation_<rotation>``).
``quality.kv_quant`` records every KIVI knob the side ran with (``bench kv-quant --kv-quant
KNOB=VALUE``, e.g. ``sink_tokens=4``), ``quality.prefill_kv`` the one that decides what prompt
scores mean (``--prefill-kv``): under ``exact`` (the CPU default) a prompt attends to its own
unquantized K/V (in one step, or across steps through the exact prompt buffer), so prompt
perplexity and agreement measure only what decode reads; run ``--prefill-kv cache`` to score
every prompt position as a decode step would read it.
"""

from __future__ import annotations

from typing import Any

DEFAULT_DTYPE = "kivi_4bit"
# model dtype of both sides; ``bench kv-quant --dtype float32`` where vLLM's bf16 CPU path is
# unreliable (the ratio is then against a float32 cache: twice the bf16 one's)
MODEL_DTYPE = "bfloat16"
KV_CACHE_BYTES = 1 << 30
MAX_NUM_SEQS = 16  # more than the benchmark ever runs at once; sizes the residual pool


def engine_extra(kv_cache_dtype: str, model_dtype: str = MODEL_DTYPE,
                 knobs: dict[str, Any] | None = None,
                 max_num_batched_tokens: int | None = None) -> dict[str, Any]:
    """Engine settings of one side: the cache dtype, the model dtype, a fixed KV-cache size;
    ``knobs`` the KIVI knobs ``kv_quant.*`` (``bench kv-quant --kv-quant``/``--prefill-kv``),
    ``max_num_batched_tokens`` vLLM's prefill step size (``--max-num-batched-tokens``)."""
    engine: dict[str, Any] = {"kv_cache_dtype": kv_cache_dtype, "dtype": model_dtype,
                              "kv_cache_memory_bytes": KV_CACHE_BYTES,
                              "max_num_seqs": MAX_NUM_SEQS}
    if max_num_batched_tokens:
        engine["max_num_batched_tokens"] = max_num_batched_tokens
    if knobs:
        engine["additional_config"] = {"vllm_accel": {"kv_quant": dict(knobs)}}
    return engine


def _model_kv_shape(engine: dict[str, Any]) -> dict[str, int]:
    """Layers, KV heads, head size and bytes per element of the engine's model."""
    import json
    from pathlib import Path

    import torch

    cfg = json.loads((Path(engine["model"]) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {"num_layers": cfg["num_hidden_layers"],
            "num_kv_heads": cfg.get("num_key_value_heads", heads),
            "head_size": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "dtype_bytes": getattr(torch, engine.get("dtype", MODEL_DTYPE)).itemsize}


def residual_pool_bytes(engine: dict[str, Any]) -> int:
    """Bytes of the KIVI residual pool the engine ``engine`` allocates (0 for other dtypes)."""
    from vllm_accel.kernels.kivi_format import PRESETS
    from vllm_accel.kv_quant.config import load_knobs
    from vllm_accel.kv_quant.tail_pool import entries_per_request, pool_bytes

    knobs = load_knobs(engine.get("additional_config"))
    if engine.get("kv_cache_dtype", "auto") not in PRESETS or knobs.residual != "tail":
        return 0
    return pool_bytes(
        **_model_kv_shape(engine), key_group=knobs.key_group,
        max_requests=engine["max_num_seqs"],
        entries_per_slot=entries_per_request(bool(engine.get("speculative_config"))))


def prompt_buffer_bytes(engine: dict[str, Any]) -> int:
    """The most bytes the KIVI exact prompt buffer of a CPU engine holds (0 when off): it
    holds them only while a prompt longer than one prefill step is being prefilled."""
    import torch

    from vllm_accel.kernels.kivi_format import PRESETS
    from vllm_accel.kv_quant.config import exact_prefill, load_knobs
    from vllm_accel.kv_quant.prompt_kv import buffer_bytes

    knobs = load_knobs(engine.get("additional_config"))
    if (engine.get("kv_cache_dtype", "auto") not in PRESETS or not knobs.prompt_exact_tokens
            or not exact_prefill(knobs, torch.device("cpu"))):  # the bench runs on the CPU
        return 0
    return buffer_bytes(capacity_tokens=knobs.prompt_exact_tokens, **_model_kv_shape(engine))


def finish_engine(engine: dict[str, Any]) -> dict[str, Any]:
    """The KV budget net of the residual pool, so both sides use the same memory."""
    return {**engine, "kv_cache_memory_bytes":
            engine["kv_cache_memory_bytes"] - residual_pool_bytes(engine)}


def other_value_rotation(plan: Any, accelerated: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The extra side of ``--set extra_sides=true``: the accelerated side's engine with the
    other ``kv_quant.value_rotation`` (``none`` <-> ``hadamard``; ``auto`` is resolved for the
    model's head size first), so a run compares the cache, the format as configured, and the
    format with the value rotation switched, on the same prompts (the quality tasks only).
    Named ``value_rotation_<rotation>``."""
    import copy

    from vllm_accel.kv_quant.config import load_knobs, resolve_value_rotation

    engine = accelerated["engine"]
    rotation = resolve_value_rotation(load_knobs(engine.get("additional_config")).value_rotation,
                                      _model_kv_shape(engine)["head_size"])
    other = "none" if rotation == "hadamard" else "hadamard"
    config = copy.deepcopy(engine.get("additional_config") or {})
    config.setdefault("vllm_accel", {}).setdefault("kv_quant", {})["value_rotation"] = other
    # ``run_feature`` nets the residual pool from the budget again (``finish_engine``)
    budget = engine["kv_cache_memory_bytes"] + residual_pool_bytes(engine)
    return {f"value_rotation_{other}": {**engine, "kv_cache_memory_bytes": budget,
                                        "additional_config": config}}


def _tokens(side: dict[str, Any]) -> int:
    return int(side["num_kv_blocks"]) * int(side["block_size"])


def report(baseline: dict[str, Any], accelerated: dict[str, Any]
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kv_capacity_ratio`` and bytes per token from each side's blocks; ppl under the names
    the KV-quantization literature uses."""
    base_tokens, quant_tokens = _tokens(baseline), _tokens(accelerated)
    pool = residual_pool_bytes(accelerated["engine"])
    ratios = {
        "kv_capacity_ratio": quant_tokens / base_tokens,
        "kv_tokens_baseline": base_tokens,
        "kv_tokens_quant": quant_tokens,
        "kv_bytes_per_token_baseline":
            baseline["engine"]["kv_cache_memory_bytes"] / base_tokens,
        "kv_bytes_per_token_quant":
            (accelerated["engine"]["kv_cache_memory_bytes"] + pool) / quant_tokens,
        "tail_pool_bytes": pool,
        "prompt_buffer_bytes": prompt_buffer_bytes(accelerated["engine"]),
    }
    import dataclasses

    from vllm_accel.kv_quant.config import load_knobs

    knobs = load_knobs(accelerated["engine"].get("additional_config"))
    quality = {"ppl_bf16": baseline.get("perplexity"), "ppl_quant": accelerated.get("perplexity"),
               # with ``exact``, a prompt prefilled in one step attends to its own unquantized
               # K/V: its perplexity is the bf16 cache's; ``cache`` reads as decode steps do
               "prefill_kv": knobs.prefill_kv, "kv_quant": dataclasses.asdict(knobs)}
    return ratios, quality
