"""Reject malformed ``kv_transfer_params`` in the request front end (HTTP 400), not mid-run.

vLLM 0.32 hands ``kv_transfer_params`` (OpenAI request field, or ``SamplingParams.extra_args``)
to the KV connector only inside the engine core, where a request can no longer be refused: the
chunk-reuse connector could only log a malformed ``chunk_spans`` and serve the request without
reuse. The patch wraps ``InputProcessor.process_inputs``
(vllm/v1/engine/input_processor.py:373 in 0.32.0), which every request passes through in the
API server and in ``LLM``/``LLMEngine``, before it reaches the engine core: once the request is
built, the configured connector class's ``validate_kv_transfer_params(vllm_config,
prompt_token_ids, kv_transfer_params)`` classmethod (if it has one) checks it, and a
``ValueError`` becomes vLLM's ``VLLMValidationError`` naming the parameter (400 Bad Request
from the OpenAI server, raised by ``LLM.generate``; checked with both). Connectors without the
classmethod, and engines without ``--kv-transfer-config``, are not affected. Refusals are
counted in ``vllm:kv_transfer_params_rejected_total`` (the API server's ``/metrics``).

Applied when ``vllm.v1.engine.input_processor`` is imported (front-end processes; engine-core
and worker processes never load it). Upstream twin:
``patches/0010-kv-connector-request-validation.patch`` (the classmethod on
``KVConnectorBase_V1`` with a no-op default, called by ``InputProcessor``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_accel.patching import RuntimePatch

VALIDATOR = "validate_kv_transfer_params"


_VALIDATORS: dict[tuple[str, str | None], Callable[..., None] | None] = {}


def _validator(kv_config: Any) -> Callable[..., None] | None:
    """The connector class's validator, looked up once per connector."""
    key = (kv_config.kv_connector, kv_config.kv_connector_module_path)
    if key not in _VALIDATORS:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        connector_cls = KVConnectorFactory.get_connector_class(kv_config)
        _VALIDATORS[key] = getattr(connector_cls, VALIDATOR, None)
    return _VALIDATORS[key]


@functools.cache
def _rejections() -> Any:
    import prometheus_client

    return prometheus_client.Counter(
        "vllm:kv_transfer_params_rejected",
        "Requests refused before scheduling for malformed kv_transfer_params (HTTP 400)")


def validate_request(vllm_config: Any, request: Any) -> None:
    """Raise ``VLLMValidationError`` when the configured connector refuses the request's
    ``kv_transfer_params``."""
    kv_config = vllm_config.kv_transfer_config
    params = request.sampling_params
    if kv_config is None or kv_config.kv_connector is None or params is None:
        return
    validate = _validator(kv_config)
    if validate is None:
        return
    try:
        validate(vllm_config, request.prompt_token_ids,
                 (params.extra_args or {}).get("kv_transfer_params"))
    except ValueError as exc:
        from vllm.exceptions import VLLMValidationError

        _rejections().inc()
        raise VLLMValidationError(str(exc), parameter="kv_transfer_params") from None


def _make_replacement(original: Any) -> Any:
    @functools.wraps(original)
    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        validate_request(self.vllm_config, request)
        return request

    return process_inputs


PATCH = RuntimePatch(
    name="kv_transfer_params_validation",
    target="vllm.v1.engine.input_processor:InputProcessor.process_inputs",
    vllm_versions=("0.32.0",),
    upstream_diff="0010-kv-connector-request-validation.patch",
    reason="KV connectors cannot refuse a request's kv_transfer_params before it is scheduled",
    make_replacement=_make_replacement,
)
