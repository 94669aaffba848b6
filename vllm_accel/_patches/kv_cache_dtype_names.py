"""Make vLLM accept vllm_accel's ``--kv-cache-dtype`` names (``kivi_4bit``, ``kivi_2bit``).

vLLM 0.32 validates the KV-cache dtype against one ``typing.Literal`` (``CacheDType`` in
``vllm/config/cache.py``) that several places copied at import time, and maps names to storage
dtypes with the ``STR_DTYPE_TO_TORCH_DTYPE`` table. A new name has no extension point, so it needs
five attribute replacements (the recipe of integration-map §5.2), each one :class:`RuntimePatch`:

==============================  ===================================================================
patch                           what it replaces
==============================  ===================================================================
``kv_cache_dtype_literal``      ``vllm.config.cache.CacheDType``: the Literal, widened
``cache_config_cache_dtype``    ``CacheConfig.__init__``: pydantic's ``__init__``/validator,
                                rebuilt after the ``cache_dtype`` field annotation is widened
``engine_args_cli_choices``     ``vllm.engine.arg_utils._compute_kwargs``: a fresh cache, so the
                                ``--kv-cache-dtype`` argparse choices come from the widened field
``selector_cache_dtype``        ``vllm.v1.attention.selector.CacheDType`` (its backend assert)
``kv_cache_torch_dtype``        ``vllm.utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE``: adds
                                ``<name> -> torch.uint8`` (the page is bytes)
==============================  ===================================================================

Order matters (the Literal first); :data:`PATCHES` lists them in order. Unknown names still get
vLLM's own errors (argparse ``invalid choice``, pydantic ``ValidationError``). Conflict check:
each replacement first checks that vLLM's object is the 0.32.0 original (the Literal's names are
exactly vLLM's), so a plugin that widened the Literal first is refused instead of overwritten.
Upstream twin: ``patches/0005-config-kivi-kv-cache-dtypes.patch`` (adds the names to the
Literal and the dtype table; all five replacements become unnecessary).
"""

from __future__ import annotations

import functools
import typing
from typing import Any

import torch

from vllm_accel.attention.registry import KV_CACHE_DTYPE_BACKENDS
from vllm_accel.patching import PatchError, RuntimePatch

VLLM_VERSIONS = ("0.32.0",)
UPSTREAM_DIFF = "0005-config-kivi-kv-cache-dtypes.patch"

# The names vllm_accel adds, and the bytes they are stored as.
NEW_KV_CACHE_DTYPES: tuple[str, ...] = tuple(KV_CACHE_DTYPE_BACKENDS)
STORAGE_DTYPE = torch.uint8

# vLLM 0.32.0's CacheDType, verbatim: anything else means someone changed it before us.
UPSTREAM_CACHE_DTYPES: tuple[str, ...] = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
    "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
    "turboquant_3bit_nc", "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head",
    "fp8_per_token_head", "nvfp4", "nvfp4_4over6",
)
WIDENED_CACHE_DTYPES = UPSTREAM_CACHE_DTYPES + NEW_KV_CACHE_DTYPES


def _widened_literal() -> Any:
    """A new ``Literal`` object with vLLM's names plus ours.

    Built without ``Literal[...]``'s cache so that each patched attribute owns a distinct object
    (the patch marker lives on the object).
    """
    return typing._LiteralGenericAlias(typing.Literal, WIDENED_CACHE_DTYPES)  # type: ignore[attr-defined]


def _require_upstream_literal(patch_name: str, literal: Any) -> None:
    if tuple(typing.get_args(literal)) != UPSTREAM_CACHE_DTYPES:
        raise PatchError(
            f"runtime patch {patch_name!r}: vLLM's CacheDType is not the 0.32.0 original "
            f"(another plugin widened it?): {typing.get_args(literal)}. Refusing to overwrite it."
        )


# --------------------------------------------------------------------------------------------
# 1. vllm.config.cache.CacheDType
# --------------------------------------------------------------------------------------------
def _replace_literal(original: Any) -> Any:
    _require_upstream_literal("kv_cache_dtype_literal", original)
    # Modules that import CacheDType later get the widened object; the selector must still hold
    # vLLM's own (patch 4 replaces it with its own object), so bind it now.
    import vllm.v1.attention.selector  # noqa: F401

    return _widened_literal()


LITERAL_PATCH = RuntimePatch(
    name="kv_cache_dtype_literal",
    target="vllm.config.cache:CacheDType",
    vllm_versions=VLLM_VERSIONS,
    upstream_diff=UPSTREAM_DIFF,
    reason="--kv-cache-dtype names are a closed Literal (adds kivi_4bit, kivi_2bit)",
    make_replacement=_replace_literal,
    original_module="typing",
)


# --------------------------------------------------------------------------------------------
# 2. CacheConfig's pydantic validation (its generated __init__ and validator)
# --------------------------------------------------------------------------------------------
def _rebuild_cache_config(original_init: Any) -> Any:
    import pydantic
    from vllm.config import cache as cache_mod

    cls = cache_mod.CacheConfig
    widened = cache_mod.CacheDType
    if tuple(typing.get_args(widened)) != WIDENED_CACHE_DTYPES:
        raise PatchError(
            "runtime patch 'cache_config_cache_dtype' needs 'kv_cache_dtype_literal' applied first"
        )
    field = cls.__dataclass_fields__["cache_dtype"]
    current = field.type
    if isinstance(current, str):  # postponed annotation: resolve it the way pydantic would
        current = getattr(cache_mod, current, None)
    if current is not widened:
        _require_upstream_literal("cache_config_cache_dtype", current)
    cls.__annotations__["cache_dtype"] = widened
    field.type = widened
    cls.__pydantic_fields__["cache_dtype"].annotation = widened
    pydantic.dataclasses.rebuild_dataclass(cls, force=True)
    return cls.__dict__["__init__"]


CACHE_CONFIG_PATCH = RuntimePatch(
    name="cache_config_cache_dtype",
    target="vllm.config.cache:CacheConfig.__init__",
    vllm_versions=VLLM_VERSIONS,
    upstream_diff=UPSTREAM_DIFF,
    reason="CacheConfig.cache_dtype is validated by pydantic against the closed Literal",
    make_replacement=_rebuild_cache_config,
    original_module="pydantic._internal._dataclasses",
)


# --------------------------------------------------------------------------------------------
# 3. argparse choices (EngineArgs caches each config class's CLI kwargs)
# --------------------------------------------------------------------------------------------
def _fresh_kwargs_cache(original: Any) -> Any:
    compute = getattr(original, "__wrapped__", None)
    if compute is None or not hasattr(original, "cache_clear"):
        raise PatchError(
            "runtime patch 'engine_args_cli_choices': vllm.engine.arg_utils._compute_kwargs is "
            "not the lru_cache-wrapped function of vLLM 0.32.0"
        )
    return functools.lru_cache(maxsize=30)(compute)


CLI_CHOICES_PATCH = RuntimePatch(
    name="engine_args_cli_choices",
    target="vllm.engine.arg_utils:_compute_kwargs",
    vllm_versions=VLLM_VERSIONS,
    upstream_diff=UPSTREAM_DIFF,
    reason="the --kv-cache-dtype argparse choices are cached from the closed Literal",
    make_replacement=_fresh_kwargs_cache,
)


# --------------------------------------------------------------------------------------------
# 4. the attention selector's copy of CacheDType (it asserts the layer's dtype is in it)
# --------------------------------------------------------------------------------------------
def _replace_selector_literal(original: Any) -> Any:
    _require_upstream_literal("selector_cache_dtype", original)
    return _widened_literal()


SELECTOR_PATCH = RuntimePatch(
    name="selector_cache_dtype",
    target="vllm.v1.attention.selector:CacheDType",
    vllm_versions=VLLM_VERSIONS,
    upstream_diff=UPSTREAM_DIFF,
    reason="get_attn_backend asserts the KV-cache dtype is in its copy of the closed Literal",
    make_replacement=_replace_selector_literal,
    original_module="typing",
)


# --------------------------------------------------------------------------------------------
# 5. storage dtype of each name
# --------------------------------------------------------------------------------------------
class _KvDtypeTable(dict):
    """vLLM's name -> torch dtype table with vllm_accel's names added (a dict subclass only so
    that it can carry the patch marker)."""


def _extend_dtype_table(original: Any) -> Any:
    clash = [n for n in NEW_KV_CACHE_DTYPES if n in original]
    if clash:
        raise PatchError(
            f"runtime patch 'kv_cache_torch_dtype': STR_DTYPE_TO_TORCH_DTYPE already maps {clash}"
        )
    table = _KvDtypeTable(original)
    table.update({name: STORAGE_DTYPE for name in NEW_KV_CACHE_DTYPES})
    return table


DTYPE_TABLE_PATCH = RuntimePatch(
    name="kv_cache_torch_dtype",
    target="vllm.utils.torch_utils:STR_DTYPE_TO_TORCH_DTYPE",
    vllm_versions=VLLM_VERSIONS,
    upstream_diff=UPSTREAM_DIFF,
    reason="the KV-cache dtype name -> storage dtype table has no registration hook",
    make_replacement=_extend_dtype_table,
)


PATCHES: list[RuntimePatch] = [
    LITERAL_PATCH,
    CACHE_CONFIG_PATCH,
    CLI_CHOICES_PATCH,
    SELECTOR_PATCH,
    DTYPE_TABLE_PATCH,
]
