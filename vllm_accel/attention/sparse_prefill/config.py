"""The ``sparse_prefill`` knobs of ``--attention-backend ACCEL_SPARSE_PREFILL``.

Set them with ``--additional-config '{"vllm_accel": {"sparse_prefill": {"tau": 0.9}}}'`` or per
knob with environment variables (``VLLM_ACCEL_SPARSE_PREFILL_TAU=0.9``, lists and objects as
JSON). A bad value fails at engine start-up with a message naming the knob. This module does
not import vLLM.

Budgets. For each (query block, KV head) of a long prefill, key blocks are ranked by their
estimated attention mass and kept while the kept mass is below ``tau`` *and* the count is below
``min(ceil(density * causal blocks), max_blocks)``; the first ``num_sink_blocks`` and the last
``num_local_blocks`` (plus the diagonal) are always kept. Any budget left ``null`` is no limit;
all three ``null`` (or ``density=1``) selects every causal block, which is dense attention
computed by the sparse kernel (a correctness check).

Per-layer and per-head budgets: ``layer_budgets`` maps layer indices (``"3"``) or inclusive
ranges (``"0-5"``) to ``{"tau": ..., "density": ..., "max_blocks": ...}``; a key given there
replaces the global value for those layers, and a value may be a list with one entry per KV
head (``{"12": {"density": [0.3, 0.1]}}``; ``null`` entries mean no limit for that head).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from vllm_accel.config import AccelConfigError, knob, register_section

SECTION = "sparse_prefill"
METHODS = ("antidiagonal", "mean_pool", "oracle", "dense")
GQA_MODES = ("pool_query", "mean_mass", "per_query_head")
BUDGET_KEYS = ("tau", "density", "max_blocks")
#: Prompts (context + chunk) at least this long take the sparse path by default. Chosen from
#: in-engine measurements on Qwen2.5-Coder-0.5B (fp32, 2-core AVX2 CPU; table in the docstring
#: of ``vllm_accel.attention.sparse_prefill``): attention is already a third of the TTFT of a
#: 4K prompt, and the first 2K chunk that reaches 4K tokens runs its attention 3.4x faster
#: sparse (density 0.28); below 4K the absolute gain is a few seconds at most, not worth the
#: risk of dropping a block that matters on the short prompts that make up most traffic.
DEFAULT_THRESHOLD = 4096


@register_section(SECTION)
@dataclass(frozen=True)
class SparsePrefillConfig:
    #: How key blocks are scored: "antidiagonal" (XAttention-style strided antidiagonal sums),
    #: "mean_pool" (mean query . mean key; cheapest), "oracle" (true attention mass from a dense
    #: pass: a quality upper bound for benchmarks, slower than dense), or "dense" (never sparse:
    #: every request through vLLM's CPU kernel, with the timing statistics; a baseline).
    method: str = "antidiagonal"
    #: Keep key blocks until this fraction of the estimated attention mass is covered.
    tau: float | None = 0.9
    #: Top-k budget as a fraction of the causal key blocks of each query block.
    density: float | None = None
    #: Top-k budget as a number of key blocks per query block.
    max_blocks: int | None = None
    #: Query rows per block (a multiple of key_block_size; 256 suits the CPU kernel).
    query_block_size: int = 256
    #: Keys per block (the selection granularity).
    key_block_size: int = 64
    #: Antidiagonal tile size S (block sizes must be multiples of it).
    stride: int = 16
    #: Key blocks at the start of the sequence that are always kept (attention sinks).
    num_sink_blocks: int = 1
    #: Key blocks before each query block's diagonal that are always kept.
    num_local_blocks: int = 1
    #: The last this many query blocks of every sparse prefill chunk attend to every causal
    #: key block: the final rows of a prompt (the question, and the token that produces the
    #: first output) get exact attention (costs about dense_tail_blocks * query_block_size *
    #: seq_len per chunk). Default 1: with 0, Qwen2.5-Coder-0.5B lost 1 of 5 needles and 2 of 2
    #: multi-key retrievals at 8K (dense: all found); with 1, all were found again.
    dense_tail_blocks: int = 1
    #: Selection per KV-head group ("pool_query", "mean_mass") or per query head.
    gqa: str = "pool_query"
    #: Requests whose context + new tokens reach this many tokens are prefilled sparsely;
    #: shorter ones, and every decode, run vLLM's dense CPU kernel.
    threshold: int = DEFAULT_THRESHOLD
    #: Layer indices that always run dense (e.g. [0, 1]).
    dense_layers: tuple[int, ...] = ()
    #: Per-layer / per-KV-head budget overrides (see the module docstring), a JSON object.
    layer_budgets: dict[str, Any] | None = None
    #: If set, every worker appends one JSON line per engine step with sparse work to this
    #: file: attention time, tokens and achieved density (read by ``vllm-accel bench``).
    stats_path: str | None = None

    def validate(self) -> dict[str, str]:
        problems: dict[str, str] = {}
        if self.method not in METHODS:
            problems["method"] = f"choose one of {', '.join(METHODS)}"
        if self.tau is not None and not 0.0 < self.tau <= 1.0:
            problems["tau"] = "must be in (0, 1], or null for no mass threshold"
        if self.density is not None and not 0.0 < self.density <= 1.0:
            problems["density"] = "must be in (0, 1], or null for no top-k fraction"
        if self.max_blocks is not None and self.max_blocks < 1:
            problems["max_blocks"] = "must be >= 1, or null for no top-k count"
        if self.stride < 1:
            problems["stride"] = "must be >= 1"
        if self.key_block_size < 16 or self.key_block_size % max(self.stride, 1):
            problems["key_block_size"] = f"must be >= 16 and a multiple of stride ({self.stride})"
        if (self.query_block_size < self.key_block_size
                or self.query_block_size % max(self.key_block_size, 1)):
            problems["query_block_size"] = (
                f"must be a multiple of key_block_size ({self.key_block_size})")
        if self.num_sink_blocks < 0:
            problems["num_sink_blocks"] = "must be >= 0"
        if self.num_local_blocks < 0:
            problems["num_local_blocks"] = "must be >= 0"
        if self.dense_tail_blocks < 0:
            problems["dense_tail_blocks"] = "must be >= 0"
        if self.gqa not in GQA_MODES:
            problems["gqa"] = f"choose one of {', '.join(GQA_MODES)}"
        if self.threshold < 1:
            problems["threshold"] = "must be >= 1 (tokens of context + chunk)"
        if any(i < 0 for i in self.dense_layers):
            problems["dense_layers"] = "layer indices must be >= 0"
        try:
            parse_layer_budgets(self.layer_budgets)
        except ValueError as exc:
            problems["layer_budgets"] = str(exc)
        if self.stats_path is not None and not self.stats_path.strip():
            problems["stats_path"] = "must be a file path (or leave it unset)"
        return problems

    def check_model(self, num_layers: int, num_kv_heads: int) -> None:
        """Start-up checks that need the model: layer indices and per-head list lengths."""
        bad = [i for i in self.dense_layers if i >= num_layers]
        if bad:
            raise AccelConfigError(
                f"{knob(SECTION, 'dense_layers')}={list(self.dense_layers)!r}: layers {bad} do "
                f"not exist (the model has {num_layers} layers, 0..{num_layers - 1})")
        for (first, last), budget in parse_layer_budgets(self.layer_budgets):
            if last >= num_layers:
                raise AccelConfigError(
                    f"{knob(SECTION, 'layer_budgets')}: layer {last} does not exist (the model "
                    f"has {num_layers} layers)")
            for key, value in budget.items():
                if isinstance(value, tuple) and len(value) != num_kv_heads:
                    raise AccelConfigError(
                        f"{knob(SECTION, 'layer_budgets')}: layers {first}-{last} {key} has "
                        f"{len(value)} entries; the model has {num_kv_heads} KV heads")

    def budget_for_layer(self, layer_index: int | None) -> dict[str, Any]:
        """``{"tau", "density", "max_blocks"}`` for one layer: scalars, or per-KV-head tuples."""
        budget = {"tau": self.tau, "density": self.density, "max_blocks": self.max_blocks}
        if layer_index is None:
            return budget
        for (first, last), override in parse_layer_budgets(self.layer_budgets):
            if first <= layer_index <= last:
                budget.update(override)
        return budget

    def is_dense_layer(self, layer_index: int | None) -> bool:
        return self.method == "dense" or (layer_index is not None
                                          and layer_index in self.dense_layers)


def _check_budget_value(key: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{key}={value!r}: expected a number or null")
    if key in ("tau", "density") and not 0.0 < value <= 1.0:
        raise ValueError(f"{key}={value!r}: must be in (0, 1]")
    if key == "max_blocks" and (value < 1 or int(value) != value):
        raise ValueError(f"{key}={value!r}: must be an integer >= 1")


def _parse_layer_key(key: str) -> tuple[int, int]:
    try:
        if "-" in key:
            first, last = (int(x) for x in key.split("-", 1))
        else:
            first = last = int(key)
    except ValueError:
        raise ValueError(f"layer key {key!r}: expected a layer index like \"3\" or a range "
                         f"like \"0-5\"") from None
    if first < 0 or last < first:
        raise ValueError(f"layer key {key!r}: expected 0 <= first <= last")
    return first, last


def parse_layer_budgets(raw: Any) -> list[tuple[tuple[int, int], dict[str, Any]]]:
    """``layer_budgets`` as ``[((first, last), {key: scalar | tuple per KV head})]``.

    Accepts the JSON object or its text (from an environment variable); raises ``ValueError``
    with the offending entry.
    """
    if raw is None:
        return []
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object {\"<layer or first-last>\": {\"tau\": ...}}")
    parsed = []
    for key, budget in raw.items():
        span = _parse_layer_key(str(key))
        if not isinstance(budget, dict) or not budget:
            raise ValueError(f"layer {key!r}: expected an object with any of {BUDGET_KEYS}")
        unknown = set(budget) - set(BUDGET_KEYS)
        if unknown:
            raise ValueError(f"layer {key!r}: unknown budget(s) {sorted(unknown)}; "
                             f"known: {list(BUDGET_KEYS)}")
        clean: dict[str, Any] = {}
        for name, value in budget.items():
            if isinstance(value, list):
                if not value:
                    raise ValueError(f"layer {key!r}: {name} per-head list is empty")
                for v in value:
                    _check_budget_value(name, v)
                clean[name] = tuple(value)
            else:
                _check_budget_value(name, value)
                clean[name] = value
        parsed.append((span, clean))
    return parsed
