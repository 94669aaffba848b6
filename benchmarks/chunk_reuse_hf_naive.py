"""Naive and APE chunk reuse outside vLLM: does the model answer from assembled, re-rotated KV?

Builds the plan of ``vllm-accel bench chunk-reuse`` (NUM_DOCUMENTS documents of ~512 tokens,
QUESTIONS questions), stores each document's KV from its warm-up prompt (``prefix SEP doc SEP``:
APE's parallel encoding with a shared prefix) with transformers, assembles every question's
context from the stored chunks (keys re-rotated with ``kernels.rope_rerotate``, values as they
are), and decodes the answer greedily; compares with full computation. Each ``T:S`` argument adds
a side whose question and generated tokens attend to the chunks with APE's temperature ``T`` and
scale ``S`` (``kernels.ape_attention``, the kernel the connector uses). Separates "the method
loses accuracy on this model" from "the engine path is wrong", and sweeps APE's knobs cheaply
(the stored KV is shared by all sides).

    flock /tmp/cpu.lock .venv/bin/python benchmarks/chunk_reuse_hf_naive.py 8 8 0.5:1.0 0.7:0.9

Measured (Qwen2.5-Coder-0.5B fp32, this project's 2-core Xeon, 2026-12-02; 8 documents, 7 of 8
questions before the run was stopped): full 6/7, naive reuse 0/7, and 0/7 for every APE setting
tried (T in 0.3/0.5/0.7/0.85 x S in 0.8/0.9/1.0, and T 1 with S 0.9/1.1/1.2). Lower
temperatures move the wrong answer from one document's code to another's; the model does not
find the asked-for document in parallel-encoded chunks at any setting. (Earlier, 4 questions:
full 4/4, naive 1/4, the same as the engine's naive side.)
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicCache

from vllm_accel.bench.chunk_reuse_workload import build, score
from vllm_accel.kernels.ape_attention import ape_attention
from vllm_accel.kernels.rope_rerotate import rerotate_keys, rope_cos_sin_cache

MODEL = "~/.cache/vllm-accel/models/qwen2.5-coder-0.5b-instruct"
#: The APE side being decoded: chunk mask over positions, temperature, scale (None: ordinary).
_APE: dict[str, object] = {"mask": None, "temperature": 1.0, "scale": 1.0}


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention: SDPA, or APE over the chunk mask while an APE side decodes.
    ``query [1, H, q, D]`` at the last ``q`` of ``key [1, Hkv, S, D]``'s positions."""
    num_q, num_keys = query.shape[2], key.shape[2]
    positions = torch.arange(num_keys - num_q, num_keys)
    mask = _APE["mask"]
    if mask is None:
        visible = torch.arange(num_keys)[None, :] <= positions[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=visible[None, None], scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    chunk = torch.zeros(num_keys, dtype=torch.bool)
    chunk[: min(num_keys, mask.numel())] = mask[:num_keys]
    out = ape_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),
                        value[0].transpose(0, 1), positions, chunk, scaling,
                        _APE["temperature"], _APE["scale"])
    return out[None].contiguous(), None


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    AttentionInterface.register("vllm_accel_ape", _attention)
    model_dir = os.path.expanduser(MODEL)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="vllm_accel_ape").eval()
    cfg = model.config
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    cos_sin = rope_cos_sin_cache(cfg.hidden_size // cfg.num_attention_heads, 32768, base=theta)
    num_docs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    num_questions = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    ape_sides = [tuple(float(x) for x in arg.split(":")) for arg in sys.argv[3:]]
    work = build(tok, [num_docs], 512, num_questions, max(1, num_questions // 4))
    sep = work.separator_id

    def marks(ids):
        return [i for i, t in enumerate(ids) if t == sep]

    @torch.no_grad()
    def layer_kv(ids):
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
        return [(layer.keys[0], layer.values[0]) for layer in cache.layers]  # [H, T, D]

    @torch.no_grad()
    def greedy(cache, ids, start, n=16):
        out, pos = [], torch.arange(start, start + len(ids))[None]
        o = model(torch.tensor([ids]), past_key_values=cache, position_ids=pos, use_cache=True)
        for i in range(n):
            out.append(int(o.logits[0, -1].argmax()))
            o = model(torch.tensor([[out[-1]]]), past_key_values=o.past_key_values,
                      position_ids=torch.tensor([[start + len(ids) + i]]), use_cache=True)
        return tok.decode(out)

    def assembled(q, m):
        cache = DynamicCache()
        prefix_end = stored[q.order[0]][0]
        for layer in range(cfg.num_hidden_layers):
            keys = [stored[q.order[0]][2][layer][0][:, :prefix_end]]
            values = [stored[q.order[0]][2][layer][1][:, :prefix_end]]
            for j, d in enumerate(q.order):
                start, end, kv = stored[d]
                k = kv[layer][0][:, start:end].transpose(0, 1).contiguous()
                keys.append(rerotate_keys(k, m[j] - start, cos_sin).transpose(0, 1))
                values.append(kv[layer][1][:, start:end])
            cache.update(torch.cat(keys, 1)[None], torch.cat(values, 1)[None], layer)
        return cache

    stored = []
    for prompt in work.warmup:
        start, end = marks(prompt)[:2]
        stored.append((start, end, layer_kv(list(prompt))))
    sides = ["full", "naive"] + [f"ape T={t} S={s}" for t, s in ape_sides]
    totals = dict.fromkeys(sides, 0)
    for q in work.questions:
        prompt = list(q.prompt)
        m = marks(prompt)
        _APE["mask"] = None
        answers = {"full": greedy(DynamicCache(), prompt, 0),
                   "naive": greedy(assembled(q, m), prompt[m[-1]:], m[-1])}
        chunk = torch.zeros(len(prompt), dtype=torch.bool)
        chunk[m[0]:m[-1]] = True  # the reused documents, not the system prefix
        for (t, s), side in zip(ape_sides, sides[2:]):
            _APE.update(mask=chunk, temperature=t, scale=s)
            answers[side] = greedy(assembled(q, m), prompt[m[-1]:], m[-1])
        _APE["mask"] = None
        for side, text in answers.items():
            totals[side] += score(q.expected, text)
        print(q.expected, {side: text[:16] for side, text in answers.items()}, flush=True)
    print({k: f"{v}/{len(work.questions)}" for k, v in totals.items()})


if __name__ == "__main__":
    main()
