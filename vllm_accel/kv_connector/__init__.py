"""Position-independent KV reuse: ``--kv-transfer-config '{"kv_connector": "ChunkReuseConnector",
"kv_connector_module_path": "vllm_accel.kv_connector", "kv_role": "kv_both"}'``.

vLLM's connector factory imports this module and reads ``ChunkReuseConnector`` from it; the
class (and vLLM with it) is imported only then, so the pure parts of this package (chunking,
identity, planner, stores) import without vLLM.
"""

from __future__ import annotations

from typing import Any

CONNECTOR_NAME = "ChunkReuseConnector"


def __getattr__(name: str) -> Any:
    if name == CONNECTOR_NAME:
        from vllm_accel.kv_connector.connector import ChunkReuseConnector

        return ChunkReuseConnector
    raise AttributeError(name)
