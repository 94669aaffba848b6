"""The SPEED oracle against the per-layer mask reference and plain HF, on the tiny models.

The tiny random Llama / Qwen2 models (``vllm_accel.models.tiny``, 4 layers) are loaded in fp32.
"""

from __future__ import annotations

import pytest
import torch

from vllm_accel.speed.policy import upper_prompt_positions
from vllm_accel.speed.reference import (
    masked_reference_generate,
    speed_generate,
    speed_greedy,
    speed_layer_masks,
)

NEW_TOKENS = 6


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from vllm_accel.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("speed") / request.param,
                            architecture=request.param)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt(length=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 512, (length - 1,), generator=g).tolist()  # BoS first


def _max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("which_cut", ["one", "half", "all_but_one"])
@pytest.mark.parametrize("anchor", [1, 3])
def test_oracle_matches_the_mask_reference(model, which_cut, anchor):
    num_layers = model.config.num_hidden_layers
    cut = {"one": 1, "half": num_layers // 2, "all_but_one": num_layers - 1}[which_cut]
    prompt = _prompt()
    fast = speed_generate(model, prompt, NEW_TOKENS, cut, anchor)
    slow = masked_reference_generate(model, prompt, NEW_TOKENS, cut, anchor)
    assert fast.tokens == slow.tokens
    assert len(fast.logits) == NEW_TOKENS
    assert _max_diff(fast, slow) < 1e-4


def test_full_depth_equals_plain_hf_generate(model):
    num_layers = model.config.num_hidden_layers
    prompt = _prompt(seed=1)
    ours = speed_generate(model, prompt, NEW_TOKENS, cut=num_layers)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=2)
    hf = out[0, len(prompt):].tolist()
    assert len(ours.tokens) == NEW_TOKENS
    # HF may stop early on EOS (id 1); the oracle does not unless asked to.
    assert ours.tokens[:len(hf)] == hf and (len(hf) == NEW_TOKENS or hf[-1] == 1)
    # ... and every step's logits equal a plain forward over the sequence so far.
    ids = list(prompt)
    with torch.no_grad():
        for token, logits in zip(ours.tokens, ours.logits):
            plain = model(torch.tensor([ids])).logits[0, -1].float()
            assert float((plain - logits).abs().max()) < 1e-4
            ids.append(token)
    # The fraction 1.0 is the same thing.
    assert speed_greedy(model, prompt, NEW_TOKENS, cut=1.0) == ours.tokens


def test_the_policy_changes_the_output(model):
    num_layers = model.config.num_hidden_layers
    prompt = _prompt(length=60, seed=2)
    dense = speed_generate(model, prompt, NEW_TOKENS, cut=num_layers)
    for cut in (1, num_layers - 1):
        shallow = speed_generate(model, prompt, NEW_TOKENS, cut=cut)
        assert _max_diff(dense, shallow) > 1e-2
    outputs = {tuple(speed_greedy(model, prompt, NEW_TOKENS, cut=c))
               for c in range(1, num_layers + 1)}
    assert len(outputs) > 1


def test_upper_layers_really_skip_prompt_tokens(model):
    """Prompt tokens reach the upper layers' MLPs only as anchor + last rows."""
    num_layers = model.config.num_hidden_layers
    cut, anchor, prompt = num_layers // 2, 3, _prompt(length=40)
    rows: dict[int, list[int]] = {i: [] for i in range(num_layers)}
    hooks = [layer.mlp.register_forward_hook(
        lambda mod, args, out, i=i: rows[i].append(args[0].shape[-2]))
        for i, layer in enumerate(model.model.layers)]
    try:
        speed_generate(model, prompt, 3, cut, anchor)
    finally:
        for hook in hooks:
            hook.remove()
    upper_rows = len(upper_prompt_positions(len(prompt), anchor))
    assert upper_rows == 4
    for i in range(num_layers):
        expected_prefill = len(prompt) if i < cut else upper_rows
        assert rows[i] == [expected_prefill, 1, 1]  # prefill, then two decode steps


def test_layer_masks():
    masks = speed_layer_masks(total_len=8, prompt_len=5, anchor_tokens=1, num_lower=1,
                              num_layers=2)
    assert torch.equal(masks[0], torch.ones(8, 8, dtype=torch.bool).tril())
    # Upper layer, the decode token at position 6 sees anchor 0, last prompt 4, and 5, 6.
    assert masks[1][6].tolist() == [True, False, False, False, True, True, True, False]
    # The last prompt token sees the anchor and itself.
    assert masks[1][4].tolist() == [True, False, False, False, True, False, False, False]


def test_unsupported_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="model types"):
        speed_greedy(gpt2, [1, 2, 3], 2, cut=1)
