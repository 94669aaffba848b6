"""Bad flags fail at start-up with a message that names the problem and the fix."""

from __future__ import annotations

import pytest


def test_unknown_accel_backend_name_lists_the_valid_ones(tiny_llama):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_accel import plugin

    plugin.register()
    args = EngineArgs(model=tiny_llama, attention_backend="ACCEL_NOPE", max_model_len=512)
    with pytest.raises(ValueError, match="Unknown attention backend: 'ACCEL_NOPE'.*ACCEL_BASE"):
        args.create_engine_config()


@pytest.mark.parametrize("extra, match", [
    ({"recompute": "all"}, r"kv_connector_extra_config\.recompute='all': must be one of"),
    ({"stores": ["s3://bucket"]}, r"kv_connector_extra_config\.stores: .*accepted forms"),
    ({"chunk_separator": "hello world"}, r"chunk_separator='hello world': not a single token"),
    ({"epic_tokens": "many"}, r"kv_connector_extra_config\.epic_tokens='many': expected int"),
])
def test_chunk_reuse_connector_knobs_fail_at_start_up(tiny_llama, extra, match):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from vllm_accel.kv_connector import ChunkReuseConnector

    args = EngineArgs(model=tiny_llama, max_model_len=512, kv_transfer_config={
        "kv_connector": "ChunkReuseConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "vllm_accel.kv_connector",
        "kv_connector_extra_config": extra})
    config = args.create_engine_config()
    with pytest.raises(ValueError, match=match):
        ChunkReuseConnector(config, KVConnectorRole.SCHEDULER, None)
