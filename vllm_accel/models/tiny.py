"""A tiny random model for plumbing tests: built locally in seconds, no download.

Llama (RoPE, GQA 4 query / 2 KV heads, head_dim 64) or Qwen2 architecture, with a byte-level
BPE tokenizer trained on a few paragraphs. The weights are random (seeded), so its text is
gibberish, but it exercises exactly the code paths of the real models of the same
architecture: use it to test wiring (backends, connectors, proposers), and the real models
(``vllm_accel.models.fetch_model``) for output quality.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "vLLM is a fast and easy-to-use library for LLM inference and serving. ",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Attention is all you need. Keys, values and queries; blocks, pages and caches. ",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 ",
]


def _train_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    fast.save_pretrained(out)


def build_tiny_model(
    out_dir: str | os.PathLike,
    architecture: str = "llama",
    num_layers: int = 4,
    seed: int = 0,
    max_position_embeddings: int = 4096,
) -> Path:
    """Write a tiny random ``architecture`` ("llama" or "qwen2") model to ``out_dir``.

    Idempotent: an existing complete build (marked by ``tiny_model.json``) is reused.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    out = Path(out_dir)
    marker = out / "tiny_model.json"
    spec = {"architecture": architecture, "num_layers": num_layers, "seed": seed,
            "max_position_embeddings": max_position_embeddings}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}.get(architecture)
    if config_cls is None:
        raise ValueError(
            f"tiny model architecture must be 'llama' or 'qwen2', got {architecture!r}")

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".tiny-") as tmp:
        tmp_path = Path(tmp)
        _train_tokenizer(tmp_path, vocab_size=512)
        config = config_cls(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=max_position_embeddings,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
            tie_word_embeddings=True,
            dtype="bfloat16",
        )
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        # Larger-than-default init so the random model's greedy choices are not all ties.
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.08)
        model.save_pretrained(tmp_path, safe_serialization=True)
        (tmp_path / "tiny_model.json").write_text(json.dumps(spec))
        if out.exists():
            import shutil

            shutil.rmtree(out)
        os.replace(tmp_path, out)
        os.makedirs(tmp_path, exist_ok=True)  # TemporaryDirectory cleanup expects it
    return out
