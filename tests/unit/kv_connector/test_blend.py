"""Selective recompute (``blend.recompute_tokens``) against a dense reference forward.

A tiny decoder with vLLM's layer interfaces (``layer(positions, hidden, residual)``,
``self_attn.attn(q, k, v)``, ``rotary_emb(positions, q, k)``, fused add-RMSNorm) is run densely
over a prompt to get every layer's exact K/V. Recomputing tokens through the paged pages must
reproduce exactly those K/V wherever the inputs were exact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_accel.kernels.rope_rerotate import apply_rope, rope_cos_sin_cache
from vllm_accel.kv_connector import blend
from vllm_accel.kv_connector.blend import question_attention_peaks, recompute_tokens
from vllm_accel.kv_connector.paged_kv import PagedLayerKV

H, HKV, D, HIDDEN, LAYERS, PAGE = 4, 2, 8, 32, 3, 16


class _Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(HIDDEN) + 0.5)

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return out if residual is None else (out, residual)


class _Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary_dim, self.is_neox_style = D, True
        self.cos_sin_cache = rope_cos_sin_cache(D, 4096)

    def forward(self, positions, q, k):
        n = q.shape[0]
        return (apply_rope(q.view(n, -1, D), positions, self.cos_sin_cache).view(n, -1),
                apply_rope(k.view(n, -1, D), positions, self.cos_sin_cache).view(n, -1))


class _DenseAttn(nn.Module):
    """Causal attention over the rows it is given (the reference); records K/V."""

    num_heads, num_kv_heads, head_size = H, HKV, D

    def __init__(self):
        super().__init__()
        self.impl = type("Impl", (), {"scale": D ** -0.5})()
        self.recorded = self.probs = None

    def forward(self, q, k, v):
        n = q.shape[0]
        self.recorded = (k.view(n, HKV, D).clone(), v.view(n, HKV, D).clone())
        qh = q.view(n, H, D).transpose(0, 1)
        kh = k.view(n, HKV, D).transpose(0, 1).repeat_interleave(H // HKV, 0)
        vh = v.view(n, HKV, D).transpose(0, 1).repeat_interleave(H // HKV, 0)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        self.probs = ((qh @ kh.transpose(1, 2)) * self.impl.scale).masked_fill(
            ~causal, float("-inf")).softmax(-1)  # [H, n, n]
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                               scale=self.impl.scale)
        return out.transpose(0, 1).reshape(n, H * D)


class _SelfAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, (H + 2 * HKV) * D)
        self.o_proj = nn.Linear(H * D, HIDDEN)
        self.rotary_emb, self.attn = _Rotary(), _DenseAttn()

    def forward(self, positions, hidden_states):
        q, k, v = self.qkv_proj(hidden_states).split([H * D, HKV * D, HKV * D], -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _Norm(), _Norm()
        self.self_attn = _SelfAttn()
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 64), nn.SiLU(), nn.Linear(64, HIDDEN))

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(100, HIDDEN)
        self.model.embed_input_ids = self.model.embed
        self.model.layers = nn.ModuleList(_Layer() for _ in range(LAYERS))
        self.model.norm, self.lm_head = _Norm(), nn.Linear(HIDDEN, 100)

    def compute_logits(self, hidden):
        return self.lm_head(hidden)


def _dense_forward(model, tokens):
    """Every layer's recorded K/V and attention probabilities, and the logits of each row."""
    with torch.no_grad():
        hidden, residual = model.model.embed_input_ids(tokens), None
        recorded, probs = [], []
        for layer in model.model.layers:
            hidden, residual = layer(torch.arange(len(tokens)), hidden, residual)
            recorded.append(layer.self_attn.attn.recorded)
            probs.append(layer.self_attn.attn.probs)
        return recorded, probs, model.compute_logits(model.model.norm(hidden, residual)[0])


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = _Model().eval()
    n = 70
    tokens = torch.randint(0, 100, (n,))
    reference, model.dense_probs, _ = _dense_forward(model, tokens)
    num_pages = 8
    caches = [torch.randn(num_pages, HKV, PAGE, 2 * D) for _ in range(LAYERS)]  # garbage
    layers_kv = [PagedLayerKV(c, PAGE, cpu_isa="plain") for c in caches]
    block_table = torch.tensor([5, 2, 7, 0, 3])
    return model, tokens, reference, layers_kv, block_table


def _fill(layers_kv, block_table, reference, positions):
    for paged, (k, v) in zip(layers_kv, reference):
        paged.write(block_table, positions, k[positions], v[positions])


def _assert_pages_match(layers_kv, block_table, reference, positions):
    for paged, (k, v) in zip(layers_kv, reference):
        got_k, got_v = paged.read(block_table, positions)
        torch.testing.assert_close(got_k, k[positions], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_v, v[positions], atol=1e-5, rtol=1e-5)


def test_recomputing_every_token_reproduces_the_dense_kv(setup):
    model, tokens, reference, layers_kv, block_table = setup
    positions = torch.arange(len(tokens))
    result = recompute_tokens(model, layers_kv, block_table, tokens, positions)
    assert result.rows_per_layer == [len(tokens)] * LAYERS
    _assert_pages_match(layers_kv, block_table, reference, positions)


def test_recomputing_a_missing_range_between_exact_kv(setup):
    model, tokens, reference, layers_kv, block_table = setup
    missing = torch.arange(20, 45)
    exact = torch.cat([torch.arange(0, 20), torch.arange(45, 70)])
    _fill(layers_kv, block_table, reference, exact)
    recompute_tokens(model, layers_kv, block_table, tokens[missing], missing)
    _assert_pages_match(layers_kv, block_table, reference, torch.arange(70))


@pytest.mark.parametrize("rows_per_block", [1, 7, 64])
def test_scattered_rows_in_small_blocks_read_every_key_before_them(setup, monkeypatch,
                                                                   rows_per_block):
    # row blocks read only the keys up to their last row: too few keys would change the KV of
    # the next layer's rows, too many (without the causal mask) too
    model, tokens, reference, layers_kv, block_table = setup
    monkeypatch.setattr(blend, "_QUERY_ROWS_PER_BLOCK", rows_per_block)
    scattered = torch.tensor([0, 3, 4, 9, 21, 22, 23, 40, 58, 69])
    rest = torch.tensor([p for p in range(70) if p not in set(scattered.tolist())])
    _fill(layers_kv, block_table, reference, rest)
    recompute_tokens(model, layers_kv, block_table, tokens[scattered], scattered)
    _assert_pages_match(layers_kv, block_table, reference, torch.arange(70))


def test_missing_kv_not_recomputed_stays_wrong(setup):
    """The check above can fail: skip part of the missing range and the KV differs."""
    model, tokens, reference, layers_kv, block_table = setup
    exact = torch.cat([torch.arange(0, 20), torch.arange(45, 70)])
    _fill(layers_kv, block_table, reference, exact)
    partial = torch.arange(30, 45)
    recompute_tokens(model, layers_kv, block_table, tokens[partial], partial)
    with pytest.raises(AssertionError):
        _assert_pages_match(layers_kv, block_table, reference, partial)


def test_cacheblend_keeps_the_most_deviating_rows(setup):
    model, tokens, reference, layers_kv, block_table = setup
    _fill(layers_kv, block_table, reference, torch.arange(70))
    positions = torch.arange(10, 70)
    # corrupt the stored layer-1 keys of three tokens: CacheBlend must pick exactly those
    corrupt = torch.tensor([17, 33, 61])
    k1, _ = layers_kv[1].read(block_table, corrupt)
    layers_kv[1].write(block_table, corrupt, k1 + 5.0, None)
    candidates = torch.ones(len(positions), dtype=torch.bool)
    candidates[:2] = False  # e.g. tokens with no stored KV: always kept
    result = recompute_tokens(model, layers_kv, block_table, tokens[positions], positions,
                              candidates=candidates, ratio=3 / 58)
    assert result.rows_per_layer == [60, 60, 5]
    assert result.last_positions.tolist() == [10, 11, 17, 33, 61]
    # layers 0 and 1 got fresh KV for every row, so the corruption is gone
    _assert_pages_match(layers_kv, block_table, reference, torch.arange(70))


def test_cacheblend_ratio_one_recomputes_everything(setup):
    model, tokens, reference, layers_kv, block_table = setup
    positions = torch.arange(len(tokens))
    candidates = torch.ones(len(tokens), dtype=torch.bool)
    result = recompute_tokens(model, layers_kv, block_table, tokens, positions,
                              candidates=candidates, ratio=1.0)
    assert result.rows_per_layer == [70] * LAYERS
    _assert_pages_match(layers_kv, block_table, reference, positions)


def test_query_probe_reads_the_questions_attention_over_exact_pages(setup):
    """With exact KV in the pages, the probe of the suffix is the dense forward: each page
    position's peak is the largest dense attention probability a question row gives it in the
    scored layers, and nothing is written."""
    model, tokens, reference, layers_kv, block_table = setup
    first, score_from = 52, 58  # pages hold [0, 52); rows 52..57 end a chunk, 58.. the question
    _fill(layers_kv, block_table, reference, torch.arange(first))
    valid = torch.ones(first, dtype=torch.bool)
    for first_scored in (0, LAYERS - 1):
        peaks, token_layers = question_attention_peaks(
            model, layers_kv, block_table, tokens[first:], valid, score_from, first_scored)
        expected = torch.stack([p[:, score_from:, :first].amax(dim=(0, 1))
                                for p in model.dense_probs[first_scored:]]).amax(dim=0)
        torch.testing.assert_close(peaks, expected, atol=1e-5, rtol=1e-4)
    assert token_layers == (len(tokens) - first) * LAYERS
    _assert_pages_match(layers_kv, block_table, reference, torch.arange(first))


def test_query_probe_drafts_the_greedy_answer_and_scores_its_rows(setup):
    """With ``draft_tokens``, the probe's rows are those of the dense forward over the prompt
    extended by its greedy continuation: the peaks include what the draft rows read (the check
    can fail: the draft's tokens, positions and attention to the question's rows must all be
    right), and nothing is written."""
    model, tokens, reference, layers_kv, block_table = setup
    first, score_from, draft = 52, 58, 4
    _fill(layers_kv, block_table, reference, torch.arange(first))
    extended = tokens
    for _ in range(draft):
        logits = _dense_forward(model, extended)[2]
        extended = torch.cat([extended, logits[-1:].argmax(dim=-1)])
    _, probs, _ = _dense_forward(model, extended)
    valid = torch.ones(first, dtype=torch.bool)
    peaks, token_layers = question_attention_peaks(
        model, layers_kv, block_table, tokens[first:], valid, score_from, 1, draft_tokens=draft)
    expected = torch.stack([p[:, score_from:, :first].amax(dim=(0, 1)) for p in probs[1:]])
    torch.testing.assert_close(peaks, expected.amax(dim=0), atol=1e-5, rtol=1e-4)
    assert token_layers == (len(tokens) - first + draft) * LAYERS
    question_only = question_attention_peaks(model, layers_kv, block_table, tokens[first:],
                                             valid, score_from, 1)[0]
    assert not torch.allclose(peaks, question_only, atol=1e-4)
    _assert_pages_match(layers_kv, block_table, reference, torch.arange(first))


def test_query_probe_ignores_invalid_page_keys(setup):
    """Positions still to compute hold garbage: masked out, they get no attention and do not
    change what the question reads elsewhere (the check can fail: unmasked, the garbage is
    read)."""
    model, tokens, reference, layers_kv, block_table = setup
    first = 52

    def probe(valid):
        return question_attention_peaks(model, layers_kv, block_table, tokens[first:], valid,
                                        first, 0)[0]

    _fill(layers_kv, block_table, reference, torch.arange(first))
    valid = torch.ones(first, dtype=torch.bool)
    clean = probe(valid)
    garbage = torch.arange(20, 30)
    for paged in layers_kv:
        paged.write(block_table, garbage, torch.randn(10, HKV, D) * 50, torch.randn(10, HKV, D))
    assert not torch.allclose(probe(valid), clean, atol=1e-3)
    valid[garbage] = False
    masked = probe(valid)
    assert torch.all(masked[garbage] == 0)
