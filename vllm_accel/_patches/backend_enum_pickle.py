"""Make vllm_accel's attention-backend enum members survive pickling into spawned workers.

vLLM registers out-of-tree backends as *new members* of ``AttentionBackendEnum`` at runtime.
Enum members pickle by value, and a spawned EngineCore/Worker unpickles the ``VllmConfig``
before it loads general plugins, so the member does not exist yet there:
``ValueError: '...AccelBaseBackend' is not a valid AttentionBackendEnum``.

The patch makes our members (only ours) pickle as ``restore_backend(name, class_path)``, which
re-registers the member in the child if it is missing. Upstream twin:
``patches/0001-attention-registry-pickle-registered-backends.patch``.
"""

from __future__ import annotations

from typing import Any

from vllm_accel.attention.registry import BACKENDS
from vllm_accel.patching import RuntimePatch


def restore_backend(name: str, class_path: str) -> Any:
    """Unpickling hook: return the enum member ``name``, registering it first if needed."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if name not in AttentionBackendEnum.__members__:
        register_backend(name, class_path)
    return AttentionBackendEnum[name]


def _make_replacement(original: Any) -> Any:
    def __reduce_ex__(self, protocol):  # noqa: N807 (dunder by design)
        if self.name in BACKENDS:
            return restore_backend, (self.name, self.get_path())
        return original(self, protocol)

    return __reduce_ex__


PATCH = RuntimePatch(
    name="backend_enum_pickle",
    target="vllm.v1.attention.backends.registry:AttentionBackendEnum.__reduce_ex__",
    vllm_versions=("0.32.0",),
    upstream_diff="0001-attention-registry-pickle-registered-backends.patch",
    reason="registered backend names must unpickle in spawned EngineCore/Worker processes",
    make_replacement=_make_replacement,
    original_module="enum",  # vLLM's enum inherits Enum.__reduce_ex__
)
