"""Typed, validated feature knobs that vLLM has no flag for.

Users set them in one place::

    --additional-config '{"vllm_accel": {"sparse_prefill": {"tau": 0.9}, "speed": {"cut": 0.75}}}'

or per knob with environment variables (``VLLM_ACCEL_SPARSE_PREFILL_TAU=0.9``), which win over
the JSON. Each feature declares its section as a frozen dataclass with defaults and a
``validate() -> dict[knob, reason]`` method (empty when valid), registers it with
:func:`register_section`, and reads it with :func:`load_section`. A wrong value fails at start-up
with a message naming the knob, the value and what is allowed::

    ValueError: --additional-config vllm_accel.sparse_prefill.tau=1.5: must be in (0, 1]

Unknown sections or keys fail the same way (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

ROOT = "vllm_accel"
_SECTIONS: dict[str, type] = {}
# The module that declares each section. Imported before a section name is judged unknown: a
# process that has loaded one feature only (e.g. a proposer in the worker) must still accept
# the sections of the other features configured in the same engine.
SECTION_MODULES = {
    "kv_quant": "vllm_accel.kv_quant.config",
    "sparse_prefill": "vllm_accel.attention.sparse_prefill.config",
    "spec_decode": "vllm_accel.spec_decode.knobs",
    "speed": "vllm_accel.speed.config",
}


class AccelConfigError(ValueError):
    pass


def register_section(name: str):
    """Class decorator: declare ``cls`` (a dataclass) as the knobs of section ``name``."""

    def wrap(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass")
        _SECTIONS[name] = cls
        return cls

    return wrap


def sections() -> dict[str, type]:
    """Every declared section (all of :data:`SECTION_MODULES`, plus any registered since)."""
    for module in SECTION_MODULES.values():
        importlib.import_module(module)
    return dict(_SECTIONS)


def knob(section: str, key: str) -> str:
    return f"--additional-config {ROOT}.{section}.{key}"


def _coerce(section: str, key: str, value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        annotation = args[0]
        origin = typing.get_origin(annotation)
    if origin is tuple:
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, (list, tuple)):
            raise AccelConfigError(f"{knob(section, key)}={value!r}: expected a list")
        (item,) = {a for a in typing.get_args(annotation) if a is not Ellipsis}
        return tuple(_coerce(section, key, v, item) for v in value)
    if annotation is bool:
        if isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
        if isinstance(value, bool):
            return value
        raise AccelConfigError(f"{knob(section, key)}={value!r}: expected true or false")
    if annotation in (int, float, str):
        try:
            if annotation is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return annotation(value)
        except (TypeError, ValueError):
            raise AccelConfigError(
                f"{knob(section, key)}={value!r}: expected {annotation.__name__}") from None
    return value


def load_section(name: str, additional_config: dict[str, Any] | None,
                 environ: typing.Mapping[str, str] | None = None) -> Any:
    """The validated knobs of section ``name`` from vLLM's ``additional_config`` and the env."""
    cls = _SECTIONS[name]
    environ = os.environ if environ is None else environ
    root = (additional_config or {}).get(ROOT, {}) or {}
    if not isinstance(root, dict):
        raise AccelConfigError(f"--additional-config {ROOT} must be a JSON object")
    known = sections() if set(root) - set(_SECTIONS) else _SECTIONS
    unknown_sections = set(root) - set(known)
    if unknown_sections:
        raise AccelConfigError(
            f"--additional-config {ROOT}: unknown section(s) {sorted(unknown_sections)}; "
            f"known: {sorted(known)}")
    raw = dict(root.get(name, {}) or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(fields)
    if unknown:
        raise AccelConfigError(f"--additional-config {ROOT}.{name}: unknown key(s) "
                               f"{sorted(unknown)}; known: {sorted(fields)}")
    prefix = f"VLLM_ACCEL_{name.upper()}_"
    for key in fields:
        if prefix + key.upper() in environ:
            raw[key] = environ[prefix + key.upper()]
    hints = typing.get_type_hints(cls)
    values = {k: _coerce(name, k, v, hints[k]) for k, v in raw.items()}
    config = cls(**values)
    problems = config.validate() if hasattr(config, "validate") else {}
    if problems:
        key, why = next(iter(problems.items()))
        raise AccelConfigError(f"{knob(name, key)}={getattr(config, key)!r}: {why}")
    return config
