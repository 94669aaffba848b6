"""On-disk chunk store: one checksummed file per key, written atomically, optionally bounded.

Layout: ``<path>/<key[:2]>/<key>.chunk`` (see :mod:`.serialization` for the bytes). A write goes
to a temporary file in the same directory, is fsynced, then renamed over the target, so readers
(other processes included) see either the old file or the new one, never a partial one. With
``capacity_bytes`` the least recently used files (by mtime; a hit touches the file) are deleted
once the directory holds more than that.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from pathlib import Path

from vllm_accel.kv_connector.stores.serialization import BlobStore

SUFFIX = ".chunk"


class DiskStore(BlobStore):
    def __init__(
        self, path: str | os.PathLike[str], capacity_bytes: int | None = None, name: str = "disk"
    ) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        super().__init__(name)
        self.root = Path(path)
        self.capacity_bytes = capacity_bytes
        self._used: int | None = None  # bytes under root, scanned on first need
        self._lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # puts will fail and be counted too; the engine still starts
            self._fault("errors", f"cannot create directory {self.root}", exc)

    def path_for(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def _read(self, key: str) -> bytes | None:
        path = self.path_for(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        if self.capacity_bytes is not None:
            with contextlib.suppress(OSError):
                os.utime(path)  # recently used: evicted last
        return blob

    def _write(self, key: str, blob: bytes) -> bool:
        if self.capacity_bytes is not None and len(blob) > self.capacity_bytes:
            return False
        path = self.path_for(key)
        path.parent.mkdir(exist_ok=True)
        try:
            old_size = path.stat().st_size
        except FileNotFoundError:
            old_size = 0
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.capacity_bytes is not None:
            self._account(len(blob) - old_size)
        return True

    def _exists(self, key: str) -> bool:
        return self.path_for(key).is_file()

    def _discard(self, key: str) -> None:
        self.path_for(key).unlink(missing_ok=True)

    def _account(self, delta: int) -> None:
        assert self.capacity_bytes is not None
        with self._lock:
            if self._used is None:
                self._used = sum(size for _, size, _ in self._files())
            else:
                self._used += delta
            if self._used > self.capacity_bytes:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        """Delete least recently used files until the directory fits (lock held)."""
        assert self.capacity_bytes is not None
        files = sorted(self._files(), key=lambda f: f[2])  # rescan: other processes write too
        used = sum(size for _, size, _ in files)
        evicted = 0
        for path, size, _ in files:
            if used <= self.capacity_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                evicted += 1
            used -= size
        self._used = used
        if evicted:
            self._stats.add(evictions=evicted)

    def _files(self) -> list[tuple[Path, int, float]]:
        """(path, size, mtime) of every stored chunk."""
        found = []
        for path in self.root.glob(f"*/*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                st = path.stat()
                found.append((path, st.st_size, st.st_mtime))
        return found
