"""A small, strict helper for the few runtime patches vllm_accel cannot avoid.

Every runtime patch is a :class:`RuntimePatch`: it names one attribute of one vLLM object
(``"vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls"``), the vLLM versions it was
written against, and the upstream diff in ``patches/`` that would make it unnecessary.

:func:`apply` enforces the rules:

* version gate: a patch only applies to the vLLM versions it names;
* idempotent: applying the same patch twice in one process is a no-op (vLLM loads general
  plugins once per process, but tests and embedders may call ``register()`` again);
* conflict check: the attribute must still be the one vLLM defines. If another patch of ours
  or another plugin already replaced it, we refuse instead of stacking blindly;
* logged and recorded: each replacement is logged once and listed by :func:`active_patches`
  (``vllm-accel doctor`` shows them).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_accel.log import get_logger

logger = get_logger("patching")

# Marker attribute set on every replacement we install.
_MARK = "__vllm_accel_patch__"


class PatchError(RuntimeError):
    """A runtime patch could not be applied safely."""


@dataclass(frozen=True)
class RuntimePatch:
    """One attribute replacement.

    ``make_replacement(original)`` receives the raw attribute as stored in the owner's
    ``__dict__`` (so a classmethod arrives as the ``classmethod`` object) and returns the raw
    object to store in its place.
    """

    name: str
    target: str  # "package.module:Owner.attribute" or "package.module:attribute"
    vllm_versions: tuple[str, ...]
    upstream_diff: str  # file name in the repository's patches/ folder
    reason: str
    make_replacement: Callable[[Any], Any]
    # Module that defines the attribute we expect to replace (defaults to the target's module).
    # Anything else found there means someone else already patched it: a conflict.
    original_module: str | None = None

    def resolve(self) -> tuple[Any, str]:
        """Return ``(owner, attribute_name)`` for the target."""
        module_name, _, path = self.target.partition(":")
        owner: Any = importlib.import_module(module_name)
        *owner_path, attribute = path.split(".")
        for part in owner_path:
            owner = getattr(owner, part)
        return owner, attribute


@dataclass(frozen=True)
class ActivePatch:
    name: str
    target: str
    upstream_diff: str
    reason: str


_ACTIVE: dict[str, ActivePatch] = {}


def _raw_attribute(owner: Any, attribute: str) -> Any:
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attribute in klass.__dict__:
                return klass.__dict__[attribute]
        raise PatchError(f"{owner.__qualname__} has no attribute {attribute!r}")
    try:
        return vars(owner)[attribute]
    except KeyError:
        raise PatchError(f"{owner!r} has no attribute {attribute!r}") from None


def _defining_module(obj: Any) -> str | None:
    func = getattr(obj, "__func__", obj)  # unwrap classmethod / staticmethod
    return getattr(func, "__module__", None)


def apply(patch: RuntimePatch, vllm_version: str) -> bool:
    """Apply ``patch``; return True if it was installed now, False if already active."""
    if vllm_version not in patch.vllm_versions:
        raise PatchError(
            f"runtime patch {patch.name!r} was written for vLLM {', '.join(patch.vllm_versions)}; "
            f"found vLLM {vllm_version}. Install the vLLM this vllm_accel release supports "
            f"or upgrade vllm_accel."
        )
    owner, attribute = patch.resolve()
    current = _raw_attribute(owner, attribute)
    owner_name = getattr(owner, "__qualname__", getattr(owner, "__name__", repr(owner)))
    marker = getattr(getattr(current, "__func__", current), _MARK, None)
    if marker == patch.name:
        return False  # ours, already in place
    if marker is not None:
        raise PatchError(
            f"runtime patch {patch.name!r}: {patch.target} is already replaced by vllm_accel "
            f"patch {marker!r}; two patches may not own one attribute"
        )
    expected_module = patch.original_module or patch.target.partition(":")[0]
    defined_in = _defining_module(current)
    if defined_in is not None and defined_in != expected_module:
        raise PatchError(
            f"runtime patch {patch.name!r}: {patch.target} was already replaced by code from "
            f"{defined_in!r} (another plugin?). Refusing to stack patches; disable one of them."
        )
    replacement = patch.make_replacement(current)
    setattr(getattr(replacement, "__func__", replacement), _MARK, patch.name)
    # type.__setattr__ bypasses metaclass guards (vLLM's backend enum has one).
    setter = type.__setattr__ if isinstance(owner, type) else setattr
    setter(owner, attribute, replacement)
    _ACTIVE[patch.name] = ActivePatch(patch.name, patch.target, patch.upstream_diff, patch.reason)
    logger.info(
        "vllm_accel: patched %s.%s (%s; upstream fix: patches/%s)",
        owner_name, attribute, patch.name, patch.upstream_diff,
    )
    return True


def active_patches() -> list[ActivePatch]:
    """The runtime patches installed in this process, in the order they were applied."""
    return list(_ACTIVE.values())
