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
