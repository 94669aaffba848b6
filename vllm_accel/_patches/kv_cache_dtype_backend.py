"""Select the backend that owns a vllm_accel ``--kv-cache-dtype`` (``kivi_*``) automatically.

A KIVI page is bytes that only its own backend can read, so ``--kv-cache-dtype kivi_4bit``
must run with ``ACCEL_KIVI_4BIT``. vLLM 0.32 picks a backend from ``--attention-backend`` and the
platform only; it has no "this KV-cache dtype needs that backend" hook. The patch wraps
``vllm.v1.attention.selector._cached_get_attn_backend`` (every attention layer's selection passes
through it, on every platform) and, for a dtype listed in
:data:`vllm_accel.attention.registry.KV_CACHE_DTYPE_BACKENDS`:

* checks the configuration first and fails at start-up naming the flag and what is supported
  (platform, ``--block-size``, ``--dtype``, head size; see
  :func:`vllm_accel.kv_quant.backend.startup_problems`);
* no ``--attention-backend`` -> selects the owning backend (the CPU platform then honours it
  through the ``cpu_backend_selection`` patch);
* another explicit backend -> error naming both flags.

A ``kivi_*`` backend named explicitly with another dtype is an error too. Every other selection
is passed to vLLM unchanged. Every engine's layers pass through here before weights load, so it
is also where the composition matrix refuses feature combinations that cannot run together
(:func:`vllm_accel.composition.check_composition`, on the config being built). Upstream twin:
``patches/0006-selector-kv-cache-dtype-backend.patch`` (a ``register_kv_cache_dtype_backend()``
table consulted by ``get_attn_backend``).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_accel.attention.registry import KV_CACHE_DTYPE_BACKENDS
from vllm_accel.log import get_logger
from vllm_accel.patching import RuntimePatch

logger = get_logger("kv_quant")

_OWNING_BACKENDS = frozenset(KV_CACHE_DTYPE_BACKENDS.values())


def resolve_backend_for_kv_dtype(selected: Any, kv_cache_dtype: str | None) -> Any:
    """The backend enum member to select for ``kv_cache_dtype`` (``selected`` if no opinion).

    Raises ``ValueError`` naming the flags when ``selected`` cannot store that dtype.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    required = KV_CACHE_DTYPE_BACKENDS.get(kv_cache_dtype or "")
    selected_name = None if selected is None else selected.name
    if required is None:
        if selected_name in _OWNING_BACKENDS:
            owned = [d for d, b in KV_CACHE_DTYPE_BACKENDS.items() if b == selected_name]
            raise ValueError(
                f"--attention-backend {selected_name} stores the KV cache as "
                f"{' / '.join(owned)}: run it with --kv-cache-dtype {owned[0]} (or drop "
                f"--attention-backend); got --kv-cache-dtype {kv_cache_dtype}"
            )
        return selected
    if selected_name is None:
        return AttentionBackendEnum[required]
    if selected_name != required:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} is stored and read only by the vllm_accel "
            f"backend {required}: drop --attention-backend (it is selected automatically) or "
            f"pass --attention-backend {required}; got --attention-backend {selected_name}"
        )
    return selected


def _make_replacement(original: Any) -> Any:
    @functools.cache
    def _cached_get_attn_backend(backend, attn_selector_config, num_heads=None, *,
                                 _run_kv_cache_dtype=None):
        from vllm.config import get_current_vllm_config_or_none

        from vllm_accel.composition import check_composition

        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is not None:
            check_composition(vllm_config)
        kv_dtype = attn_selector_config.kv_cache_dtype
        chosen = resolve_backend_for_kv_dtype(backend, kv_dtype)
        if kv_dtype in KV_CACHE_DTYPE_BACKENDS:
            from vllm_accel.kv_quant.backend import raise_startup_problems

            raise_startup_problems(kv_dtype, attn_selector_config)
            if backend is None:
                logger.info("--kv-cache-dtype %s: selecting the %s attention backend",
                            kv_dtype, chosen.name)
        return original(chosen, attn_selector_config, num_heads,
                        _run_kv_cache_dtype=_run_kv_cache_dtype)

    _cached_get_attn_backend.__doc__ = original.__doc__
    return _cached_get_attn_backend


PATCH = RuntimePatch(
    name="kv_cache_dtype_backend",
    target="vllm.v1.attention.selector:_cached_get_attn_backend",
    vllm_versions=("0.32.0",),
    upstream_diff="0006-selector-kv-cache-dtype-backend.patch",
    reason="vLLM cannot tie a KV-cache dtype to the backend that owns its page format",
    make_replacement=_make_replacement,
)
