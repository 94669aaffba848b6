"""The soak's mixed request stream (seeded, no vLLM import).

Kinds (``tag``): ``rag`` (a system line, 2-4 of a pool of essay documents in a random order,
each after the chunk separator, then a question: the chunk-reuse and sparse-prefill path),
``completion`` (an essay excerpt of random length to continue), ``chat`` (a chat completion
about a short excerpt), ``short`` (a one-line prompt). Half are streamed; about one in ten is
cancelled by the client (a stream closed after two chunks, or a plain request abandoned after
a fraction of a second); a quarter sample at temperature 0.8, the rest are greedy. No request
carries a ``seed``: vLLM 0.32's CPU model runner crashes the engine when a seeded request's
prompt is split by chunked prefill (docs/compatibility.md).
Prompt lengths are set in characters (about four per token): every prompt plus its
``max_tokens`` fits a 2048-token context.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_accel.bench.openai_load import LoadRequest

MAX_TOKENS = (8, 16, 32, 64)
KINDS = (("rag", 0.4), ("completion", 0.25), ("chat", 0.2), ("short", 0.15))
SHORT_PROMPTS = ("The capital of France is", "Write a haiku about the sea.",
                 "List three prime numbers:", "def fibonacci(n):", "Once upon a time")
PROBE = "The three most important ideas in the essay are"


def separator_text(model_dir: str) -> str:
    """The chunk separator the connector picks for this model (``chunk_separator: auto``), as
    prompt text."""
    from transformers import AutoTokenizer

    from vllm_accel.kv_connector.separator import separator_from_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.convert_ids_to_tokens(separator_from_tokenizer(tokenizer, "auto"))


def essay_pool(essays: dict[str, str], count: int, rng: random.Random,
               min_chars: int = 600, max_chars: int = 1200) -> list[str]:
    """``count`` essay excerpts of ``min_chars..max_chars`` characters, cut at sentence ends."""
    texts = [t for t in essays.values() if len(t) > 4 * max_chars]
    out = []
    for i in range(count):
        text = texts[i % len(texts)]
        start = rng.randrange(0, len(text) - 2 * max_chars)
        piece = text[start:start + rng.randint(min_chars, max_chars)]
        first, last = piece.find(". "), piece.rfind(". ")
        out.append(piece[first + 2:last + 1] if 0 <= first < last else piece)
    return out


def _prompt(kind: str, rng: random.Random, documents: Sequence[str], separator: str,
            essays: Sequence[str]) -> tuple[str, dict]:
    if kind == "rag":
        chosen = rng.sample(range(len(documents)), rng.randint(2, 4))
        text = ("You answer questions about the documents."
                + "".join(separator + documents[i] for i in chosen)
                + f"{separator}Question: what is document {rng.randint(1, len(chosen))} about? "
                "Answer:")
        return "completions", {"prompt": text}
    if kind == "completion":
        essay = essays[rng.randrange(len(essays))]
        start = rng.randrange(0, max(1, len(essay) - 4000))
        return "completions", {"prompt": essay[start:start + rng.randint(200, 4000)]}
    if kind == "chat":
        essay = essays[rng.randrange(len(essays))]
        start = rng.randrange(0, max(1, len(essay) - 1500))
        excerpt = essay[start:start + rng.randint(100, 1500)]
        return "chat/completions", {"messages": [
            {"role": "user", "content": f"Summarise this in one sentence:\n\n{excerpt}"}]}
    return "completions", {"prompt": rng.choice(SHORT_PROMPTS)}


def soak_requests(count: int, model: str, separator: str, essays: dict[str, str],
                  seed: int = 0, num_documents: int = 12) -> list[LoadRequest]:
    """``count`` requests for the served model name ``model``."""
    rng = random.Random(f"soak-{seed}")
    documents = essay_pool(essays, num_documents, rng)
    texts = [t for t in essays.values() if len(t) > 5000]
    kinds, weights = zip(*KINDS)
    requests = []
    for _ in range(count):
        kind = rng.choices(kinds, weights)[0]
        endpoint, body = _prompt(kind, rng, documents, separator, texts)
        body.update(model=model, max_tokens=rng.choice(MAX_TOKENS))
        if rng.random() < 0.25:
            body.update(temperature=0.8)
        else:
            body.update(temperature=0.0)
        req = LoadRequest(endpoint, body, stream=rng.random() < 0.5, tag=kind)
        if rng.random() < 0.1:
            if req.stream:
                req.cancel_after_chunks = 2
            else:
                req.cancel_after_s = rng.uniform(0.2, 1.0)
        requests.append(req)
    return requests


def probe_request(model: str) -> LoadRequest:
    """One short greedy request sent before and after the load: its answer must not change."""
    return LoadRequest("completions", {"model": model, "prompt": PROBE, "max_tokens": 24,
                                       "temperature": 0.0}, tag="probe")
