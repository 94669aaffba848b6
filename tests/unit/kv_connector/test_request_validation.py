"""Malformed ``kv_transfer_params`` are refused in the request front end (the
``kv_transfer_params_validation`` patch calls the connector's classmethod)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from vllm_accel._patches.kv_transfer_params_validation import validate_request


def _config(connector="ChunkReuseConnector", module_path="vllm_accel.kv_connector"):
    kv = SimpleNamespace(kv_connector=connector, kv_connector_module_path=module_path)
    return SimpleNamespace(kv_transfer_config=kv)


def _request(params, prompt_len=10):
    extra = None if params is None else {"kv_transfer_params": params}
    return SimpleNamespace(prompt_token_ids=list(range(prompt_len)),
                           sampling_params=SamplingParams(max_tokens=1, extra_args=extra))


@pytest.mark.parametrize("params, message", [
    ({"chunk_spans": [[3, 1]]}, r"\[3, 1\] must be non-empty, sorted and non-overlapping"),
    ({"chunk_spans": [[0, 10]]}, r"reaches the last prompt token \(9\)"),
    ({"chunk_spans": "0-4"}, "must be a list of"),
    ({"chunk_reuse": "no"}, "chunk_reuse must be true or false"),
    (["not", "an", "object"], "must be a JSON object"),
])
def test_malformed_chunk_params_are_a_validation_error(params, message):
    with pytest.raises(VLLMValidationError, match=message) as refused:
        validate_request(_config(), _request(params))
    assert refused.value.parameter == "kv_transfer_params"


@pytest.mark.parametrize("params", [None, {}, {"chunk_spans": [[0, 4], [6, 8]]},
                                    {"chunk_reuse": False}])
def test_well_formed_or_absent_params_pass(params):
    validate_request(_config(), _request(params))


def test_other_connectors_and_no_connector_are_untouched():
    bad = _request({"chunk_spans": [[3, 1]]})
    validate_request(_config("ExampleConnector", None), bad)  # vLLM's: no validator
    validate_request(SimpleNamespace(kv_transfer_config=None), bad)
