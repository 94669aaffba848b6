"""Naive chunk reuse outside vLLM: does the model answer from assembled, re-rotated chunk KV?

Builds the quick plan of ``vllm-accel bench chunk-reuse`` (8 documents of ~512 tokens, 4
questions), stores each document's KV from its warm-up prompt (``prefix SEP doc SEP``) with
transformers, assembles every question's context from the stored chunks (keys re-rotated with
``kernels.rope_rerotate``, values as they are), and decodes the answer greedily; compares with
full computation. Separates "the method loses accuracy on this model" from "the engine path is
wrong".

    flock /tmp/cpu.lock .venv/bin/python benchmarks/chunk_reuse_hf_naive.py [NUM_DOCUMENTS]

Measured (Qwen2.5-Coder-0.5B fp32): full 4/4, naive reuse 1/4 — the same as the engine's naive
side.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicCache

from vllm_accel.bench.chunk_reuse_workload import build, score
from vllm_accel.kernels.rope_rerotate import rerotate_keys, rope_cos_sin_cache

MODEL = "~/.cache/vllm-accel/models/qwen2.5-coder-0.5b-instruct"


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = os.path.expanduser(MODEL)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    cos_sin = rope_cos_sin_cache(cfg.hidden_size // cfg.num_attention_heads, 32768, base=theta)
    num_docs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    work = build(tok, [num_docs], 512, 4, 1)
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

    stored = []
    for prompt in work.warmup:
        start, end = marks(prompt)[:2]
        stored.append((start, end, layer_kv(list(prompt))))
    totals = {"full": 0, "naive": 0}
    for q in work.questions:
        prompt = list(q.prompt)
        m = marks(prompt)
        full = greedy(DynamicCache(), prompt, 0)
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
        naive = greedy(cache, prompt[m[-1]:], m[-1])
        totals["full"] += score(q.expected, full)
        totals["naive"] += score(q.expected, naive)
        print(q.expected, "full:", repr(full[:24]), "naive:", repr(naive[:24]), flush=True)
    print({k: f"{v}/{len(work.questions)}" for k, v in totals.items()})


if __name__ == "__main__":
    main()
