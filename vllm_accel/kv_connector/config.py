"""The ``kv_connector_extra_config`` knobs of :class:`~vllm_accel.kv_connector.ChunkReuseConnector`.

Set them in vLLM's own flag::

    --kv-transfer-config '{"kv_connector": "ChunkReuseConnector",
                           "kv_connector_module_path": "vllm_accel.kv_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"recompute": "epic",
                                                         "stores": ["memory"]}}'

A bad value fails at engine start-up with a message naming the knob and what is allowed. This
module does not import vLLM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

FLAG = "--kv-transfer-config kv_connector_extra_config"
RECOMPUTE_POLICIES = ("none", "epic", "cacheblend", "query")
#: Separators tried, in order, when ``chunk_separator`` is ``"auto"``: special tokens that the
#: tokenizers of the supported model families keep as one token (file separators of code models).
AUTO_SEPARATORS = ("<|file_sep|>", "<file_sep>", "<|fim_pad|>")


class ChunkReuseConfigError(ValueError):
    pass


def knob(name: str) -> str:
    return f"{FLAG}.{name}"


@dataclass(frozen=True)
class ChunkReuseConfig:
    #: Where chunk KV lives, fastest first: ``"memory"``, ``"disk:/path"``, ``"redis://host:port/db"``.
    stores: tuple[str, ...] = ("memory",)
    #: Size bound of the in-process memory tier.
    memory_gb: float = 2.0
    #: The single special token that starts every reusable chunk (``"auto"``: the first of
    #: :data:`AUTO_SEPARATORS` the tokenizer has).
    chunk_separator: str = "auto"
    #: ``none`` (naive reuse), ``epic`` (recompute the first ``epic_tokens`` of every reused
    #: chunk), ``cacheblend`` (recompute layer 0, then the ``recompute_ratio`` of tokens whose
    #: layer-1 keys deviate most from the loaded ones), ``query`` (the question probes the loaded
    #: pages first; the tokens its upper-layer heads read most sharply, with ``query_window``
    #: neighbours each, up to ``recompute_ratio`` of the reused tokens, run every layer). The
    #: default is the policy that kept most of full recompute's accuracy at >= 3x TTFT in
    #: ``vllm-accel bench chunk-reuse`` (docs/chunk_reuse.md).
    recompute: str = "query"
    epic_tokens: int = 16
    recompute_ratio: float = 0.15
    #: ``query``: neighbours on either side recomputed with each chosen token.
    query_window: int = 4
    #: ``query``: after the question, the probe decodes this many answer tokens greedily over
    #: the loaded KV and ranks what they read too (``0``: the question alone).
    query_draft_tokens: int = 0
    #: APE (``kv_connector/ape.py``): the question's and generated tokens' attention over the
    #: loaded chunk tokens uses logits / ``attention_temperature`` and weighs the chunk segment
    #: by ``attention_scale``; both 1 (default): ordinary attention, no extra work.
    attention_temperature: float = 1.0
    attention_scale: float = 1.0
    #: Reuse only when the loaded chunks cover at least this many tokens.
    min_reuse_tokens: int = 64
    #: Save chunks seen for the first time (``False``: read-only, e.g. a precomputed store).
    save_new_chunks: bool = True
    #: Seconds between the counter log lines of each side (``0``: after every step / finished
    #: request); a last line is logged at shutdown.
    log_interval_s: float = 10.0

    @property
    def ape(self) -> bool:
        return self.attention_temperature != 1.0 or self.attention_scale != 1.0

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * (1 << 30))

    def validate(self) -> dict[str, str]:
        bad: dict[str, str] = {}
        if not self.stores:
            bad["stores"] = "must list at least one store (e.g. [\"memory\"])"
        if self.memory_gb < 0:
            bad["memory_gb"] = "must be >= 0"
        if self.recompute not in RECOMPUTE_POLICIES:
            bad["recompute"] = f"must be one of {', '.join(RECOMPUTE_POLICIES)}"
        if not 0 <= self.epic_tokens <= 4096:
            bad["epic_tokens"] = "must be in [0, 4096]"
        if not 0 <= self.query_window <= 256:
            bad["query_window"] = "must be in [0, 256]"
        if not 0 <= self.query_draft_tokens <= 64:
            bad["query_draft_tokens"] = "must be in [0, 64]"
        elif self.query_draft_tokens and self.recompute != "query":
            bad["query_draft_tokens"] = "only the query policy drafts: set recompute to query"
        if not 0.0 <= self.recompute_ratio <= 1.0:
            bad["recompute_ratio"] = "must be in [0, 1]"
        for name in ("attention_temperature", "attention_scale"):
            if not 0.0 < getattr(self, name) <= 2.0:
                bad[name] = "must be in (0, 2] (1: ordinary attention)"
        if self.log_interval_s < 0:
            bad["log_interval_s"] = "must be >= 0"
        if self.min_reuse_tokens < 1:
            bad["min_reuse_tokens"] = "must be >= 1"
        if not isinstance(self.chunk_separator, str) or not self.chunk_separator:
            bad["chunk_separator"] = "must be a non-empty string (a single special token) or auto"
        return bad


def parse_config(extra: dict[str, Any] | None) -> ChunkReuseConfig:
    """``kv_connector_extra_config`` -> a validated :class:`ChunkReuseConfig`.

    Unknown keys fail too: a typo must not silently fall back to a default.
    """
    extra = dict(extra or {})
    names = {f.name: f for f in dataclasses.fields(ChunkReuseConfig)}
    unknown = sorted(set(extra) - set(names))
    if unknown:
        raise ChunkReuseConfigError(
            f"{knob(unknown[0])}: unknown knob; known: {', '.join(sorted(names))}")
    values: dict[str, Any] = {}
    for key, value in extra.items():
        default = getattr(ChunkReuseConfig, key, None) if key != "stores" else ()
        try:
            if key == "stores":
                if isinstance(value, str):
                    value = [value]
                value = tuple(str(v) for v in value)
            elif isinstance(default, bool):
                if not isinstance(value, bool):
                    raise TypeError
            elif isinstance(default, int):
                if isinstance(value, bool) or int(value) != value:
                    raise TypeError
                value = int(value)
            elif isinstance(default, float):
                value = float(value)
        except (TypeError, ValueError):
            raise ChunkReuseConfigError(
                f"{knob(key)}={value!r}: expected {type(default).__name__}") from None
        values[key] = value
    config = ChunkReuseConfig(**values)
    bad = config.validate()
    if bad:
        key, why = next(iter(bad.items()))
        raise ChunkReuseConfigError(f"{knob(key)}={getattr(config, key)!r}: {why}")
    return config


