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

:func:`apply_when_imported` defers a patch until its target module is imported, for targets that
only some vLLM processes load (the request front end) and that are too slow to import in every
process.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
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


def _check_version(patch: RuntimePatch, vllm_version: str) -> None:
    if vllm_version not in patch.vllm_versions:
        raise PatchError(
            f"runtime patch {patch.name!r} was written for vLLM {', '.join(patch.vllm_versions)}; "
            f"found vLLM {vllm_version}. Install the vLLM this vllm_accel release supports "
            f"or upgrade vllm_accel."
        )


def apply(patch: RuntimePatch, vllm_version: str) -> bool:
    """Apply ``patch``; return True if it was installed now, False if already active."""
    _check_version(patch, vllm_version)
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


_DEFERRED: dict[str, tuple[RuntimePatch, str]] = {}


class _ApplyAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module with a deferred patch it returns the normal spec with
    a loader that applies the patch right after the module has executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        deferred = _DEFERRED.pop(name, None)
        if deferred is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            logger.error("vllm_accel: runtime patch %r not applied: cannot hook the import of "
                         "%s", deferred[0].name, name)
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            try:
                apply(*deferred)
            except PatchError as exc:  # a failed import would break vLLM, not just this patch
                logger.error("vllm_accel: %s", exc)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


_FINDER = _ApplyAfterImport()


def apply_when_imported(patch: RuntimePatch, vllm_version: str) -> None:
    """Apply ``patch`` now if its target module is loaded, else right after its first import
    in this process (a conflict found then is logged, not raised). Version-gated now."""
    _check_version(patch, vllm_version)
    module_name = patch.target.partition(":")[0]
    if module_name in sys.modules:
        apply(patch, vllm_version)
        return
    _DEFERRED[module_name] = (patch, vllm_version)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
