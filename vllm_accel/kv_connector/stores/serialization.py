"""ChunkKV <-> bytes, and :class:`BlobStore`, the base of stores that keep serialized chunks.

Format: ``sha256(payload)`` (32 bytes) followed by ``payload``, a safetensors blob with the
tensors ``keys`` and ``values`` and the metadata strings ``format_version``,
``start_position`` and ``fingerprint``. The digest covers the whole payload, so a flipped byte
or a truncated blob raises :class:`CorruptChunkError`; a blob of another format version raises
:class:`MismatchedChunkError`. Any dtype safetensors knows (float32, float16, bfloat16, ...)
round-trips bit-exactly.
"""

from __future__ import annotations

import hashlib
import json
import struct
from abc import abstractmethod

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from vllm_accel.kv_connector.stores.base import (
    ChunkKV,
    ChunkStore,
    CorruptChunkError,
    MismatchedChunkError,
)

FORMAT_VERSION = "1"
_DIGEST_BYTES = 32


def serialize(chunk: ChunkKV) -> bytes:
    owned = chunk.to_owned()  # safetensors wants contiguous CPU tensors
    metadata = {
        "format_version": FORMAT_VERSION,
        "start_position": str(chunk.start_position),
        "fingerprint": chunk.fingerprint,
    }
    payload = st_save({"keys": owned.keys, "values": owned.values}, metadata=metadata)
    return hashlib.sha256(payload).digest() + payload


def deserialize(blob: bytes) -> ChunkKV:
    """Parse a blob made by :func:`serialize`; raises Corrupt/MismatchedChunkError."""
    if len(blob) < _DIGEST_BYTES + 8:
        raise CorruptChunkError(f"blob of {len(blob)} bytes is too short")
    digest, payload = blob[:_DIGEST_BYTES], blob[_DIGEST_BYTES:]
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptChunkError("checksum mismatch")
    try:
        metadata = _safetensors_metadata(payload)
        version = metadata.get("format_version")
        if version != FORMAT_VERSION:
            raise MismatchedChunkError(f"format version {version!r}, expected {FORMAT_VERSION!r}")
        tensors = st_load(payload)
        return ChunkKV(
            keys=tensors["keys"],
            values=tensors["values"],
            start_position=int(metadata["start_position"]),
            fingerprint=metadata["fingerprint"],
            _owned=True,
        )
    except MismatchedChunkError:
        raise
    except Exception as exc:  # a valid digest over garbage: written by something else
        raise CorruptChunkError(f"unparsable payload: {type(exc).__name__}: {exc}") from exc


def _safetensors_metadata(payload: bytes) -> dict[str, str]:
    # safetensors.torch.load drops the metadata; the header is <u64 LE length><JSON>.
    (header_len,) = struct.unpack("<Q", payload[:8])
    header = json.loads(payload[8 : 8 + header_len])
    return header.get("__metadata__") or {}


class BlobStore(ChunkStore):
    """A store of serialized chunks: subclasses move bytes, this class (de)serializes them."""

    def _load(self, key: str) -> ChunkKV | None:
        blob = self._read(key)
        return None if blob is None else deserialize(blob)

    def _store(self, key: str, chunk: ChunkKV) -> bool:
        return self._write(key, serialize(chunk))

    @abstractmethod
    def _read(self, key: str) -> bytes | None:
        """The stored blob, or None when absent."""

    @abstractmethod
    def _write(self, key: str, blob: bytes) -> bool:
        """Store the blob; False when deliberately not stored."""
