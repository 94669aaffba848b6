"""APE attention temperature/scale for requests that reuse chunks (connector side, vLLM adapter).

With ``attention_temperature`` or ``attention_scale`` (``kv_connector_extra_config``) other than
1, the worker-side connector gives every attention layer's ``impl`` a ``forward`` that first
runs vLLM's own (which also writes the step's K/V into the
pages) and then recomputes, for the rows of requests that loaded chunks, the output with
:func:`~vllm_accel.kernels.ape_attention.ape_attention`: the question's and the generated
tokens' attention over the loaded chunk tokens gets APE's temperature and scale, the rest (system
prefix, question, generated tokens, chunks computed in this request) stays ordinary. Rows of
other requests keep vLLM's output untouched.

Which tokens are "loaded chunk tokens" is the connector's plan (``candidates``: stored chunks
placed anywhere but at their original position 0, minus chunks whose load failed); the connector
records them per request when it loads (:class:`ApeRegistry`) and drops them when the request
finishes. The row -> request map of the forward comes from the ``attention_step_requests``
runtime patch (:func:`~vllm_accel.attention.step_requests.forward_req_ids`).

Cost: one extra attention per layer for those rows, in torch over the request's pages (decode
steps of those requests pay it too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_accel.attention import step_requests
from vllm_accel.kernels.ape_attention import ape_attention
from vllm_accel.kv_connector.paged_kv import PagedLayerKV


class ApeRegistry:
    """Per request: a bool mask over positions marking the loaded chunk tokens."""

    def __init__(self, temperature: float, chunk_scale: float):
        self.temperature, self.chunk_scale = temperature, chunk_scale
        self._masks: dict[str, torch.Tensor] = {}
        self.token_layers = 0  # query rows attended with APE, summed over layers

    def take_token_layers(self) -> int:
        count, self.token_layers = self.token_layers, 0
        return count

    def record(self, req_id: str, positions: list[int], length: int) -> None:
        if not positions:
            self._masks.pop(req_id, None)
            return
        mask = torch.zeros(length, dtype=torch.bool)
        mask[torch.tensor(positions, dtype=torch.long)] = True
        self._masks[req_id] = mask

    def drop(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._masks.pop(req_id, None)

    def mask(self, req_id: str | None, num_keys: int) -> torch.Tensor | None:
        stored = self._masks.get(req_id) if req_id is not None else None
        if stored is None:
            return None
        mask = torch.zeros(num_keys, dtype=torch.bool)
        n = min(num_keys, stored.numel())
        mask[:n] = stored[:n]
        return mask

    def __len__(self) -> int:
        return len(self._masks)


class _ApeForward:
    """Bound as the ``forward`` of one vLLM attention impl by :func:`install` (an instance
    attribute: the impl's class, its ``isinstance`` checks and every other attribute stay
    vLLM's)."""

    def __init__(self, impl: Any, registry: ApeRegistry, pages: Callable[[], PagedLayerKV]):
        self.impl, self.inner = impl, impl.forward
        self.registry, self.pages = registry, pages

    def __call__(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor | None = None,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.inner(layer, query, key, value, kv_cache, attn_metadata, output, *args,
                            **kwargs)
        if attn_metadata is None or not len(self.registry):
            return result
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        rows = step_requests.forward_req_ids(len(starts) - 1)
        out = (output if output is not None else result).view(query.shape[0], -1,
                                                               query.shape[-1])
        for i, req_id in enumerate(rows):
            mask = self.registry.mask(req_id, seq_lens[i])
            if mask is None:
                continue
            lo, hi, num_keys = starts[i], starts[i + 1], seq_lens[i]
            keys, values = self.pages().read(
                attn_metadata.block_table[i].long(), torch.arange(num_keys, device=query.device))
            q_positions = torch.arange(num_keys - (hi - lo), num_keys, device=query.device)
            out[lo:hi] = ape_attention(query[lo:hi].view(hi - lo, -1, query.shape[-1]), keys,
                                       values, q_positions, mask, self.impl.scale,
                                       self.registry.temperature,
                                       self.registry.chunk_scale).to(out.dtype)
            self.registry.token_layers += hi - lo
        return result



def unsupported_reason(impl: Any) -> str | None:
    """Why APE cannot wrap this impl (None: it can)."""
    for attr in ("alibi_slopes", "logits_soft_cap"):
        if getattr(impl, attr, None):
            return f"{type(impl).__name__} uses {attr}"
    window = getattr(impl, "sliding_window", None)
    if window not in (None, (-1, -1), -1):
        return f"{type(impl).__name__} uses a sliding window"
    if getattr(impl, "scale", None) is None:
        return f"{type(impl).__name__} has no softmax scale"
    return None


def install(layers: dict[str, Any], registry: ApeRegistry,
            pages_of: Callable[[str], PagedLayerKV]) -> int:
    """Give every attention layer in ``layers`` (name -> vLLM ``Attention`` module) the APE
    ``forward``, reading the layer's pages through ``pages_of(name)`` (the connector's views);
    returns how many. Raises ``ValueError`` when a layer's attention cannot take APE."""
    from vllm_accel._patches import attention_step_requests

    attention_step_requests.enable()
    for name, layer in layers.items():
        impl = layer.impl
        if isinstance(getattr(impl, "forward", None), _ApeForward):
            continue
        reason = unsupported_reason(impl)
        if reason is not None:
            raise ValueError(f"layer {name}: {reason}")
        impl.forward = _ApeForward(impl, registry, lambda name=name: pages_of(name))
    return len(layers)
