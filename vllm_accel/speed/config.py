"""The ``speed`` knobs of ``--attention-backend ACCEL_SPEED`` (shallow prefill, deep decode).

Set them with ``--additional-config '{"vllm_accel": {"speed": {"cut": 0.75}}}'`` or per knob with
environment variables (``VLLM_ACCEL_SPEED_CUT=18``). A bad value fails at engine start-up with a
message naming the knob. This module does not import vLLM.

``cut`` says how many of the model's ``L`` decoder layers see prompt tokens (the "lower"
layers, ``index < cut``); the remaining upper layers run only for the anchor tokens, each
request's last prompt token and the decode tokens. It is either

* a **fraction** (a float in ``(0, 1]``): ``round(cut * L)`` lower layers, at least 1; ``1.0``
  means every layer sees the prompt (plain dense inference, a correctness check); or
* a **layer index** (an integer ``1..L``): exactly that many lower layers.

The type decides: JSON ``1`` / env ``"1"`` is layer index 1, JSON ``1.0`` / env ``"1.0"`` is the
fraction 1.0. ``anchor_tokens`` is how many leading prompt positions keep KV in the upper layers
(the BoS attention sink; the SPEED paper uses 1).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from vllm_accel.config import ROOT, AccelConfigError, knob, load_section, register_section

SECTION = "speed"
DEFAULT_CUT = 0.75
MAX_ANCHOR_TOKENS = 16


def _parse_cut(value: Any) -> Any:
    """``value`` as an int (layer index) or float (fraction); unparseable values unchanged.

    Strings come from environment variables: ``"18"`` is an index, ``"0.75"`` a fraction.
    """
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            return value
    return value


def _parse_int(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return value
    return value


@register_section(SECTION)
@dataclass(frozen=True)
class SpeedConfig:
    #: Lower layers (those that see prompt tokens): a fraction of the layers in (0, 1] (float)
    #: or a layer count 1..L (int). Typed ``Any`` so that the generic loader keeps int vs float.
    cut: Any = DEFAULT_CUT
    #: Leading prompt tokens that keep KV in the upper layers (attention sink), 1..16.
    anchor_tokens: Any = 1

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise env strings in place; validate() reports what stays bad.
        object.__setattr__(self, "cut", _parse_cut(self.cut))
        object.__setattr__(self, "anchor_tokens", _parse_int(self.anchor_tokens))

    def validate(self) -> dict[str, str]:
        problems: dict[str, str] = {}
        cut = self.cut
        if isinstance(cut, bool) or not isinstance(cut, (int, float)):
            problems["cut"] = ("expected a fraction of the layers in (0, 1] (e.g. 0.75) or a "
                               "layer index >= 1 (e.g. 18)")
        elif isinstance(cut, int):
            if cut < 1:
                problems["cut"] = "a layer index must be >= 1 (at least one layer sees the prompt)"
        elif not 0.0 < cut <= 1.0:  # NaN fails this too
            problems["cut"] = "a fraction must be in (0, 1] (or give an integer layer index)"
        anchor = self.anchor_tokens
        if (isinstance(anchor, bool) or not isinstance(anchor, int)
                or not 1 <= anchor <= MAX_ANCHOR_TOKENS):
            problems["anchor_tokens"] = f"must be an integer in 1..{MAX_ANCHOR_TOKENS}"
        return problems

    def num_lower_layers(self, num_layers: int) -> int:
        """How many layers (indices ``0 .. n-1``) see prompt tokens, for a model of ``num_layers``.

        A fraction is rounded half up to a layer count (at least 1); an index must be at most
        ``num_layers`` (raises :class:`AccelConfigError` naming the knob otherwise).
        """
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        problems = self.validate()
        if "cut" in problems:
            raise AccelConfigError(f"{knob(SECTION, 'cut')}={self.cut!r}: {problems['cut']}")
        if isinstance(self.cut, int):
            if self.cut > num_layers:
                raise AccelConfigError(
                    f"{knob(SECTION, 'cut')}={self.cut!r}: layer index out of range (the model "
                    f"has {num_layers} layers; allowed 1..{num_layers})")
            return self.cut
        # Half up (not Python's banker's rounding): 0.75 of 30 layers is 23, not 22.
        return max(1, min(num_layers, math.floor(self.cut * num_layers + 0.5)))

    def is_dense(self, num_layers: int) -> bool:
        """True when every layer sees the prompt (SPEED then changes nothing)."""
        return self.num_lower_layers(num_layers) == num_layers


#: Key of a SPEED-adapted model's ``config.json`` (written by ``vllm-accel speed-adapt``) that
#: holds the cut and anchor it was adapted for: ``{"cut": 0.75, "anchor_tokens": 1, ...}``.
ADAPTED_CONFIG_KEY = "vllm_accel_speed"


def adapted_knobs(hf_config: Any) -> dict[str, Any]:
    """``{"cut": ..., "anchor_tokens": ...}`` of a SPEED-adapted model's config (else empty)."""
    adapted = getattr(hf_config, ADAPTED_CONFIG_KEY, None) or {}
    if not isinstance(adapted, dict):
        raise AccelConfigError(f"model config {ADAPTED_CONFIG_KEY} must be a JSON object, got "
                               f"{adapted!r}")
    return {k: adapted[k] for k in ("cut", "anchor_tokens") if k in adapted}


def resolve_speed_config(additional_config: dict[str, Any] | None, hf_config: Any,
                         environ=None) -> tuple[SpeedConfig, dict[str, str]]:
    """The SPEED knobs for a model: explicit knobs (``--additional-config``, env) win, then the
    adapted model's own values (:data:`ADAPTED_CONFIG_KEY`), then the defaults.

    Returns the config and, per knob, where its value came from (``"flag"``, ``"model"`` or
    ``"default"``), so start-up can log it and warn when a flag overrides what the model was
    adapted for.
    """
    environ = os.environ if environ is None else environ
    explicit = dict(((additional_config or {}).get(ROOT, {}) or {}).get(SECTION, {}) or {})
    explicit.update({key: environ[f"VLLM_ACCEL_SPEED_{key.upper()}"] for key in
                     ("cut", "anchor_tokens") if f"VLLM_ACCEL_SPEED_{key.upper()}" in environ})
    adapted = adapted_knobs(hf_config)
    merged = dict(additional_config or {})
    merged[ROOT] = dict(merged.get(ROOT, {}) or {})
    merged[ROOT][SECTION] = {**adapted, **explicit}
    config = load_section(SECTION, merged, environ=environ)
    sources = {key: "flag" if key in explicit else "model" if key in adapted else "default"
               for key in ("cut", "anchor_tokens")}
    return config, sources
