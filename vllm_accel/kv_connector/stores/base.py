"""Chunk-KV store interface: the :class:`ChunkKV` record, the :class:`ChunkStore` base class and
the :class:`StoreStats` counters every store shares.

:class:`ChunkStore` owns the fault policy: its public ``get``/``put``/``contains`` never raise.
Subclasses implement ``_load``/``_store``/``_exists`` (and may raise anything); the base class
times the call, checks fingerprint and shapes, counts hits, misses and faults, and logs each
fault kind once per store at WARNING (later ones at DEBUG).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm_accel.log import get_logger

_KEY_RE = re.compile(r"[0-9a-f]{8,128}")

COUNTERS = (
    "hits",
    "misses",
    "errors",  # faults: IO, connection, timeouts
    "corrupt",  # checksum or parse failure
    "mismatched",  # fingerprint, format version or shape mismatch
    "bytes_read",  # KV payload bytes (ChunkKV.nbytes) returned by hits
    "bytes_written",  # KV payload bytes stored by successful puts
    "get_seconds",
    "put_seconds",
    "puts",  # successful puts
    "evictions",
)


def put_refusal(key: str, chunk: ChunkKV) -> str | None:
    """Why ``put(key, chunk)`` must be refused, or None when it may proceed."""
    if not _KEY_RE.fullmatch(key):
        return f"refused put: key {key[:80]!r} is not a lowercase hex digest"
    problem = chunk.problem()
    if problem is not None:
        return f"refused put of malformed chunk {key[:16]}: {problem}"
    return None


class CorruptChunkError(Exception):
    """Stored data failed its checksum or could not be parsed."""


class MismatchedChunkError(Exception):
    """Stored data is intact but was written by another format version or model."""


@dataclass
class ChunkKV:
    """Keys and values of one chunk of tokens, for every layer.

    Tensors returned by a store are shared with the store's memory tier: treat them as read-only
    (re-rotating keys for a new position must produce new tensors).
    """

    keys: torch.Tensor  # [num_layers, num_tokens, num_kv_heads, head_dim]; RoPE at start_position+i
    values: torch.Tensor  # same shape and dtype as keys
    start_position: int  # absolute position of the chunk's first token when it was computed
    fingerprint: str  # model identity (weights, tokenizer, dtype, RoPE)
    # True when the tensors are private contiguous CPU copies nobody else writes to.
    _owned: bool = field(default=False, repr=False, compare=False)

    def nbytes(self) -> int:
        return (
            self.keys.numel() * self.keys.element_size()
            + self.values.numel() * self.values.element_size()
        )

    def problem(self) -> str | None:
        """Why this chunk is malformed, or None when it is well formed."""
        if self.keys.dim() != 4:
            return f"keys have {self.keys.dim()} dims, expected 4"
        if self.keys.shape != self.values.shape:
            return f"keys {tuple(self.keys.shape)} != values {tuple(self.values.shape)}"
        if self.keys.dtype != self.values.dtype:
            return f"keys {self.keys.dtype} != values {self.values.dtype}"
        if self.start_position < 0:
            return f"negative start_position {self.start_position}"
        return None

    def to_owned(self) -> ChunkKV:
        """A copy with detached contiguous CPU tensors (itself when it already is one)."""
        if self._owned:
            return self

        def copy(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t.detach())

        return ChunkKV(
            copy(self.keys), copy(self.values), self.start_position, self.fingerprint, _owned=True
        )


class StoreStats:
    """Thread-safe float counters: :data:`COUNTERS` plus any ``extra`` names."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS + extra, 0.0)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                if name not in self._values:
                    raise KeyError(f"unknown counter {name!r}")
                self._values[name] += delta

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)


class FaultLog:
    """Counts faults and logs the first of each kind at WARNING, the rest at DEBUG."""

    def __init__(self, store_name: str, stats: StoreStats) -> None:
        self._name = store_name
        self._stats = stats
        self._logger = get_logger(f"kv_connector.stores.{store_name}")
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, kind: str, message: str, exc: BaseException | None = None) -> None:
        self._stats.add(**{kind: 1})
        with self._lock:
            first = kind not in self._seen
            self._seen.add(kind)
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        suffix = " (further ones of this kind are logged at DEBUG)" if first else ""
        self._logger.log(
            logging.WARNING if first else logging.DEBUG,
            "%s store %s (%s)%s%s",
            self._name,
            message,
            kind,
            detail,
            suffix,
        )


def guarded_put(key: str, chunk: ChunkKV, stats: StoreStats, fault: FaultLog,
                write: Callable[[], None]) -> None:
    """The ``put`` contract every store keeps: refuse a bad key or chunk (counted as an error),
    run ``write``, turn any exception into a counted fault, and time the call."""
    start = time.perf_counter()
    try:
        refusal = put_refusal(key, chunk)
        if refusal is not None:
            fault("errors", refusal)
            return
        write()
    except Exception as exc:  # the contract: never raise
        fault("errors", f"put {key[:16]} failed", exc)
    finally:
        stats.add(put_seconds=time.perf_counter() - start)


class ChunkStore(ABC):
    """A key -> :class:`ChunkKV` cache whose public methods never raise."""

    name: str

    def __init__(self, name: str) -> None:
        self.name = name
        self._stats = StoreStats()
        self._fault = FaultLog(name, self._stats)

    # -- public API: never raises -------------------------------------------------------------

    def get(self, key: str, fingerprint: str) -> ChunkKV | None:
        start = time.perf_counter()
        try:
            return self._checked_get(key, fingerprint)
        finally:
            self._stats.add(get_seconds=time.perf_counter() - start)

    def put(self, key: str, chunk: ChunkKV) -> None:
        def write() -> None:
            if self._store(key, chunk):
                self._stats.add(puts=1, bytes_written=chunk.nbytes())

        guarded_put(key, chunk, self._stats, self._fault, write)

    def contains(self, key: str) -> bool:
        if not _KEY_RE.fullmatch(key):
            return False
        try:
            return self._exists(key)
        except Exception as exc:
            self._fault("errors", f"contains {key[:16]} failed", exc)
            return False

    def stats(self) -> dict[str, float]:
        return self._stats.snapshot()

    def close(self) -> None:  # noqa: B027 -- optional hook
        """Release connections or files; the default has nothing to release."""

    # -- hooks for subclasses: may raise ------------------------------------------------------

    @abstractmethod
    def _load(self, key: str) -> ChunkKV | None:
        """The stored chunk, or None when absent. Raises CorruptChunkError or
        MismatchedChunkError for bad data, anything else for faults."""

    @abstractmethod
    def _store(self, key: str, chunk: ChunkKV) -> bool:
        """Store the chunk; False when it was deliberately not stored (e.g. too large)."""

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    def _discard(self, key: str) -> None:  # noqa: B027 -- optional hook
        """Remove a corrupt entry (called after CorruptChunkError)."""

    # -- internals ----------------------------------------------------------------------------

    def _checked_get(self, key: str, fingerprint: str) -> ChunkKV | None:
        if not _KEY_RE.fullmatch(key):
            self._fault("errors", f"refused get: key {key[:80]!r} is not a hex digest")
            return None
        try:
            chunk = self._load(key)
        except CorruptChunkError as exc:
            self._fault("corrupt", f"dropped corrupt entry {key[:16]}", exc)
            self._discard_quietly(key)
            return None
        except MismatchedChunkError as exc:
            self._fault("mismatched", f"ignored entry {key[:16]}", exc)
            return None
        except Exception as exc:
            self._fault("errors", f"get {key[:16]} failed", exc)
            return None
        if chunk is None:
            self._stats.add(misses=1)
            return None
        if chunk.fingerprint != fingerprint:
            self._fault(
                "mismatched",
                f"ignored entry {key[:16]} of model {chunk.fingerprint[:16]!r}, "
                f"wanted {fingerprint[:16]!r}",
            )
            return None
        problem = chunk.problem()
        if problem is not None:
            self._fault("mismatched", f"ignored malformed entry {key[:16]}: {problem}")
            return None
        self._stats.add(hits=1, bytes_read=chunk.nbytes())
        return chunk

    def _discard_quietly(self, key: str) -> None:
        try:
            self._discard(key)
        except Exception as exc:
            self._fault("errors", f"could not remove corrupt entry {key[:16]}", exc)
