"""What a chunk's KV is keyed by: the model that computed it, the tenant, and the tokens.

A chunk key is ``sha256(model fingerprint, cache salt, token ids)``. The fingerprint covers the
weights (size plus a digest of the first and last MiB of every weight file, so it is cheap on
multi-GB checkpoints), the model config (incl. RoPE), the tokenizer, the model dtype and the
KV-cache dtype: KV saved by another model, dtype or RoPE setting can never be found, and stores
refuse a payload whose embedded fingerprint differs. The salt is vLLM's per-request
``cache_salt``: two tenants with different salts never share a chunk. This module does not
import vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

_EDGE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def _weight_files_digest(model_dir: Path) -> list[tuple[str, int, str]]:
    entries = []
    for path in sorted(model_dir.iterdir()):
        if not path.name.endswith(_WEIGHT_SUFFIXES) or not path.is_file():
            continue
        size = path.stat().st_size
        digest = hashlib.sha256()
        with path.open("rb") as f:
            digest.update(f.read(_EDGE_BYTES))
            if size > 2 * _EDGE_BYTES:
                f.seek(size - _EDGE_BYTES)
                digest.update(f.read(_EDGE_BYTES))
        entries.append((path.name, size, digest.hexdigest()))
    return entries


def model_fingerprint(model: str, tokenizer: str | None, dtype: str, kv_cache_dtype: str,
                      hf_config: dict[str, Any] | str, revision: str | None = None) -> str:
    """A short hex digest naming exactly the model whose KV a chunk holds."""
    config_text = hf_config if isinstance(hf_config, str) else json.dumps(
        hf_config, sort_keys=True, default=str)
    parts: dict[str, Any] = {
        "model": model, "revision": revision, "tokenizer": tokenizer, "dtype": str(dtype),
        "kv_cache_dtype": str(kv_cache_dtype), "config": config_text,
    }
    if os.path.isdir(model):
        parts["weights"] = _weight_files_digest(Path(model))
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def fingerprint_from_vllm(model_config: Any, cache_config: Any) -> str:
    hf_config = model_config.hf_config
    config = hf_config.to_json_string() if hasattr(hf_config, "to_json_string") else str(hf_config)
    return model_fingerprint(model_config.model, model_config.tokenizer,
                             str(model_config.dtype), str(cache_config.cache_dtype), config,
                             model_config.revision)


def chunk_key(fingerprint: str, salt: str | None, token_ids: Sequence[int] | Iterable[int]) -> str:
    digest = hashlib.sha256()
    digest.update(fingerprint.encode())
    digest.update(b"\x00salt\x00" + (salt or "").encode())
    digest.update(b"\x00tokens\x00")
    digest.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids))
    return digest.hexdigest()
