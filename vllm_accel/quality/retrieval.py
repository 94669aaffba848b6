"""RULER-style retrieval: several keys (multi-key) or several values of one key (multi-value).

* multi-key: ``num_keys`` different city→number facts at random depths; one is asked for.
  Distractors make this harder than the single needle. Score 1 if the number is in the answer.
* multi-value: ``num_values`` numbers for the same city at random depths; all are asked for.
  Score: the fraction of the values the answer contains.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from vllm_accel.quality.prompts import CITIES, chat_ids, haystack, insert_at_depths, magic_number


@dataclass(frozen=True)
class RetrievalCase:
    kind: str  # "multikey" | "multivalue"
    length: int
    answers: tuple[str, ...]
    prompt_ids: list[int]


def build_multikey(tokenizer, lengths: list[int], samples: int, num_keys: int = 4,
                   seed: int = 1) -> list[RetrievalCase]:
    rng = random.Random(seed)
    cases = []
    for length in lengths:
        for _ in range(samples):
            keys = rng.sample(CITIES, num_keys)
            values = [magic_number(rng) for _ in keys]
            facts = [(rng.random(), f"The special magic number for {k} is {v}.")
                     for k, v in zip(keys, values)]
            text = insert_at_depths(haystack(tokenizer, length - 120, rng), facts)
            target = rng.randrange(num_keys)
            question = (f"\n\nWhat is the special magic number for {keys[target]} mentioned in "
                        f"the text above? Answer with the number only.")
            cases.append(RetrievalCase("multikey", length, (values[target],),
                                       chat_ids(tokenizer, text + question)))
    return cases


def build_multivalue(tokenizer, lengths: list[int], samples: int, num_values: int = 3,
                     seed: int = 2) -> list[RetrievalCase]:
    rng = random.Random(seed)
    cases = []
    for length in lengths:
        for _ in range(samples):
            key = rng.choice(CITIES)
            values = [magic_number(rng) for _ in range(num_values)]
            facts = [(rng.random(), f"One of the special magic numbers for {key} is {v}.")
                     for v in values]
            text = insert_at_depths(haystack(tokenizer, length - 120, rng), facts)
            question = (f"\n\nWhat are all the special magic numbers for {key} mentioned in the "
                        f"text above? Answer with the numbers only, separated by commas.")
            cases.append(RetrievalCase("multivalue", length, tuple(values),
                                       chat_ids(tokenizer, text + question)))
    return cases


def score(case: RetrievalCase, answer_text: str) -> float:
    return sum(a in answer_text for a in case.answers) / len(case.answers)
