"""The PyTorch/transformers oracle of the SPEED policy, for HF Llama / Qwen2 causal LMs.

Two implementations of greedy decoding under the policy of :mod:`vllm_accel.speed.policy`:

* :func:`speed_generate` -- the **oracle** vLLM must match token for token. It really skips the
  work: prompt tokens run the lower layers only; the upper layers run on the gathered rows of the
  anchors and the last prompt token, then on each decode token, with a K/V cache per layer that
  holds exactly the upper-active tokens. It is written against the HF modules' public pieces
  (``q/k/v/o_proj``, the model's rotary embedding and ``apply_rotary_pos_emb``, ``mlp``, the
  norms, ``lm_head``), not against transformers' attention-mask or cache plumbing.
* :func:`masked_reference_generate` -- slow and obviously correct: at every step it recomputes the
  whole sequence through HF's own decoder layers, every layer on every token, with one 4-D mask
  per layer built element by element from :func:`~vllm_accel.speed.policy.upper_visible`. It is
  the check of the oracle, not something to run on long prompts.

``cut`` is the ``speed.cut`` knob (an int layer index, or a float fraction of the layers; see
:mod:`vllm_accel.speed.config`). Batch of one. No stop on EOS unless ``eos_token_id`` is given
(vLLM comparisons use ``ignore_eos``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_accel.speed.config import SpeedConfig
from vllm_accel.speed.policy import upper_prompt_positions, upper_visible

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass
class GreedyResult:
    """Generated token ids and, for each, the fp32 logits ``[vocab]`` it was chosen from."""

    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def check_config(model_type: str | None, layer_types) -> None:
    """Refuse model configs this oracle does not implement (other architectures, sliding
    windows); ``layer_types`` is the config's list (or None)."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is not supported by SPEED (supported "
                         f"model types: {', '.join(SUPPORTED_MODEL_TYPES)})")
    layer_types = layer_types or ()
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError("SPEED supports full-attention layers only; this model has "
                         f"layer types {sorted(set(layer_types))}")


def check_model(model) -> None:
    """:func:`check_config` of an HF model."""
    check_config(model.config.model_type, getattr(model.config, "layer_types", None))


def num_lower_layers(model, cut: int | float) -> int:
    """The number of lower layers for ``cut`` on ``model`` (the knob's rules)."""
    return SpeedConfig(cut=cut).num_lower_layers(len(model.model.layers))


# -- the oracle: real compute skip --------------------------------------------------------------

class LayerCache:
    """One layer's keys/values ``[1, Hkv, n, D]`` (after RoPE) and the positions they hold."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        if self.keys is None:
            self.keys, self.values, self.positions = keys, values, positions
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
            self.positions = torch.cat([self.positions, positions])

    def __len__(self) -> int:
        return 0 if self.positions is None else int(self.positions.numel())


def _apply_rope(attn, q, k, cos, sin):
    """RoPE with the function of the attention module's own modeling file."""
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)


def _attention(layer, h, cos, sin, positions, cache: LayerCache) -> torch.Tensor:
    """Self-attention of rows ``h`` ``[1, n, H]`` against ``cache`` plus themselves, causally."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    n, head_dim = h.shape[1], attn.head_dim
    q = attn.q_proj(x).view(1, n, -1, head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(1, n, -1, head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(1, n, -1, head_dim).transpose(1, 2)
    q, k = _apply_rope(attn, q, k, cos, sin)
    cache.append(k, v, positions)
    groups = q.shape[1] // cache.keys.shape[1]
    keys = cache.keys.repeat_interleave(groups, dim=1)
    values = cache.values.repeat_interleave(groups, dim=1)
    # The cache holds exactly the tokens this layer may see; only causality is left to mask.
    mask = cache.positions[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                         scale=getattr(attn, "scaling", head_dim ** -0.5))
    return attn.o_proj(out.transpose(1, 2).reshape(1, n, -1))


def run_layers(model, h, positions, caches, layer_ids) -> torch.Tensor:
    """Run decoder layers ``layer_ids`` on rows ``h`` at ``positions``, appending to ``caches``."""
    cos, sin = model.model.rotary_emb(h, positions[None, :])
    for i in layer_ids:
        layer = model.model.layers[i]
        h = h + _attention(layer, h, cos, sin, positions, caches[i])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


def _last_logits(model, h) -> torch.Tensor:
    return model.lm_head(model.model.norm(h[:, -1:]))[0, -1].float()


def _prompt_tensor(model, prompt_ids: Sequence[int]) -> torch.Tensor:
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=model.device)
    if ids.numel() < 1:
        raise ValueError("prompt_ids must hold at least one token")
    return ids


def _greedy_loop(step, first_logits, max_new_tokens, eos_token_id) -> GreedyResult:
    """Greedy decoding: ``step(token, index)`` returns the logits after feeding ``token``."""
    result = GreedyResult()
    logits = first_logits
    for i in range(max_new_tokens):
        token = int(torch.argmax(logits))
        result.tokens.append(token)
        result.logits.append(logits)
        if token == eos_token_id or i + 1 == max_new_tokens:
            break
        logits = step(token, i)
    return result


@torch.no_grad()
def speed_generate(model, prompt_ids: Sequence[int], max_new_tokens: int, cut: int | float,
                   anchor_tokens: int = 1, eos_token_id: int | None = None) -> GreedyResult:
    """Greedy decoding under SPEED with real compute skip (the oracle); see the module doc."""
    first_logits, step = _speed_prefill(model, prompt_ids, cut, anchor_tokens)
    return _greedy_loop(step, first_logits, max_new_tokens, eos_token_id)


@torch.no_grad()
def speed_continuation_logprobs(model, prompt_ids: Sequence[int],
                                continuation_ids: Sequence[int], cut: int | float,
                                anchor_tokens: int = 1) -> list[float]:
    """Log-probability of each continuation token, teacher-forced as decode tokens (full
    depth) after a SPEED prefill of the prompt: what SPEED costs in perplexity."""
    logits, step = _speed_prefill(model, prompt_ids, cut, anchor_tokens)
    out = []
    for i, token in enumerate(continuation_ids):
        out.append(float(torch.log_softmax(logits, -1)[token]))
        if i + 1 < len(continuation_ids):
            logits = step(int(token), i)
    return out


def _speed_prefill(model, prompt_ids: Sequence[int], cut: int | float, anchor_tokens: int):
    """The SPEED prefill: ``(logits after the prompt, step(token, index) -> next logits)``."""
    check_model(model)
    num_layers = len(model.model.layers)
    num_lower = num_lower_layers(model, cut)
    ids = _prompt_tensor(model, prompt_ids)
    prompt_len = ids.numel()
    caches = [LayerCache() for _ in range(num_layers)]
    lower, upper = range(num_lower), range(num_lower, num_layers)

    positions = torch.arange(prompt_len, device=ids.device)
    h = run_layers(model, model.model.embed_tokens(ids)[None], positions, caches, lower)
    rows = torch.tensor(upper_prompt_positions(prompt_len, anchor_tokens), device=ids.device)
    h = run_layers(model, h[:, rows], positions[rows], caches, upper)

    def step(token: int, index: int) -> torch.Tensor:
        pos = torch.tensor([prompt_len + index], device=ids.device)
        x = model.model.embed_tokens(torch.tensor([token], device=ids.device))[None]
        return _last_logits(model, run_layers(model, x, pos, caches, range(num_layers)))

    return _last_logits(model, h), step


def speed_greedy(model, prompt_ids: Sequence[int], max_new_tokens: int, cut: int | float,
                 anchor_tokens: int = 1, eos_token_id: int | None = None) -> list[int]:
    """The oracle's greedy token ids (what vLLM + ACCEL_SPEED must reproduce)."""
    return speed_generate(model, prompt_ids, max_new_tokens, cut, anchor_tokens,
                          eos_token_id).tokens


# -- the slow reference: every layer on every token, one mask per layer ------------------------

def speed_layer_masks(total_len: int, prompt_len: int, anchor_tokens: int, num_lower: int,
                      num_layers: int, device=None) -> list[torch.Tensor]:
    """Per-layer boolean visibility ``[total_len, total_len]`` (True = may attend)."""
    causal = torch.ones(total_len, total_len, dtype=torch.bool, device=device).tril()
    upper = torch.tensor([[upper_visible(q, k, prompt_len, anchor_tokens)
                           for k in range(total_len)] for q in range(total_len)],
                         dtype=torch.bool, device=device)
    return [causal if i < num_lower else upper for i in range(num_layers)]


def masked_forward(model, ids: torch.Tensor, prompt_len: int, num_lower: int,
                   anchor_tokens: int) -> torch.Tensor:
    """Logits ``[T, vocab]`` of HF's decoder layers run on all ``T`` tokens with SPEED masks."""
    num_layers = len(model.model.layers)
    h = model.model.embed_tokens(ids)[None]
    position_ids = torch.arange(ids.numel(), device=ids.device)[None]
    position_embeddings = model.model.rotary_emb(h, position_ids)
    masks = speed_layer_masks(ids.numel(), prompt_len, anchor_tokens, num_lower, num_layers,
                              device=ids.device)
    lowest = torch.finfo(h.dtype).min
    for layer, mask in zip(model.model.layers, masks):
        additive = torch.zeros(mask.shape, dtype=h.dtype, device=h.device)
        additive = additive.masked_fill(~mask, lowest)[None, None]
        out = layer(h, attention_mask=additive, position_ids=position_ids,
                    position_embeddings=position_embeddings)
        h = out[0] if isinstance(out, tuple) else out
    return model.lm_head(model.model.norm(h))[0].float()


@torch.no_grad()
def masked_reference_generate(model, prompt_ids: Sequence[int], max_new_tokens: int,
                              cut: int | float, anchor_tokens: int = 1,
                              eos_token_id: int | None = None) -> GreedyResult:
    """Greedy decoding under SPEED by full recomputation with per-layer masks (slow check)."""
    check_model(model)
    num_lower = num_lower_layers(model, cut)
    ids = _prompt_tensor(model, prompt_ids)
    prompt_len = ids.numel()
    state = {"ids": ids}

    def step(token: int, index: int) -> torch.Tensor:
        state["ids"] = torch.cat([state["ids"], torch.tensor([token], device=ids.device)])
        return masked_forward(model, state["ids"], prompt_len, num_lower, anchor_tokens)[-1]

    first = masked_forward(model, ids, prompt_len, num_lower, anchor_tokens)[-1]
    return _greedy_loop(step, first, max_new_tokens, eos_token_id)
