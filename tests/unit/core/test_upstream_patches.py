"""Every runtime patch has an upstream twin in patches/ that applies to the installed vLLM."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_accel._patches import all_patches

PATCH_DIR = Path(__file__).resolve().parents[3] / "patches"


def _site_packages() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parents[1]


@pytest.mark.parametrize("patch", all_patches(), ids=lambda p: p.name)
def test_upstream_diff_applies_to_installed_vllm(patch):
    diff = PATCH_DIR / patch.upstream_diff
    assert diff.is_file(), f"runtime patch {patch.name} has no upstream twin {diff}"
    if shutil.which("patch") is None:
        pytest.skip("the `patch` tool is not installed")
    result = subprocess.run(["patch", "-p1", "--dry-run", "-d", str(_site_packages()),
                             "-i", str(diff)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout and "fuzz" not in result.stdout


def test_every_diff_in_patches_belongs_to_a_runtime_patch():
    known = {p.upstream_diff for p in all_patches()}
    assert {p.name for p in PATCH_DIR.glob("*.patch")} == known
