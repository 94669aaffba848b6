"""Turning task text into the token ids both engines receive."""

from __future__ import annotations

import random
from functools import lru_cache

from vllm_accel.quality import data

CITIES = (
    "Lisbon", "Nairobi", "Osaka", "Quito", "Tbilisi", "Reykjavik", "Hanoi", "Montevideo",
    "Krakow", "Accra", "Winnipeg", "Valparaiso", "Tallinn", "Kochi", "Marrakesh", "Ljubljana",
    "Cebu", "Bergen", "Antwerp", "Cusco", "Dakar", "Perth", "Sapporo", "Zagreb",
)


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat_ids(tokenizer, user_text: str) -> list[int]:
    """Token ids of one user turn plus the assistant prefix (raw text if no chat template)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(user_text)["input_ids"]


@lru_cache(maxsize=4)
def _haystack_ids(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer(data.haystack_text(), add_special_tokens=False)["input_ids"])


def haystack(tokenizer, num_tokens: int, rng: random.Random) -> str:
    """``num_tokens`` tokens of haystack text from a random offset."""
    ids = _haystack_ids(tokenizer)
    if num_tokens > len(ids):
        raise ValueError(f"haystack holds {len(ids)} tokens; {num_tokens} requested")
    start = rng.randrange(0, len(ids) - num_tokens + 1)
    return tokenizer.decode(ids[start : start + num_tokens])


def insert_at_depths(text: str, sentences: list[tuple[float, str]]) -> str:
    """Insert each ``(depth, sentence)`` at the sentence boundary nearest ``depth`` (0..1)."""
    cuts = []
    for depth, sentence in sentences:
        pos = int(len(text) * depth)
        boundary = text.rfind(". ", 0, pos)
        cuts.append((boundary + 2 if boundary >= 0 else 0, sentence))
    for pos, sentence in sorted(cuts, reverse=True):
        text = text[:pos] + sentence + " " + text[pos:]
    return text


def magic_number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))
