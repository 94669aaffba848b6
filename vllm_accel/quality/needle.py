"""Needle in a haystack: one fact hidden at a chosen depth of a long essay text.

Each case hides "The special magic number for <city> is <7 digits>." at depth d of an L-token
haystack and asks for the number. Score: the number appears in the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from vllm_accel.quality.prompts import CITIES, chat_ids, haystack, insert_at_depths, magic_number

QUESTION = ("\n\nWhat is the special magic number for {key} mentioned in the text above? "
            "Answer with the number only.")


@dataclass(frozen=True)
class NeedleCase:
    length: int
    depth: float
    key: str
    answer: str
    prompt_ids: list[int]


def build_cases(tokenizer, lengths: list[int], depths: list[float], seed: int = 0,
                needles_per_cell: int = 1) -> list[NeedleCase]:
    rng = random.Random(seed)
    cases = []
    for length in lengths:
        for depth in depths:
            for _ in range(needles_per_cell):
                key, value = rng.choice(CITIES), magic_number(rng)
                text = haystack(tokenizer, length - 80, rng)
                text = insert_at_depths(
                    text, [(depth, f"The special magic number for {key} is {value}.")]
                )
                ids = chat_ids(tokenizer, text + QUESTION.format(key=key))
                cases.append(NeedleCase(length, depth, key, value, ids))
    return cases


def score(case: NeedleCase, answer_text: str) -> float:
    return 1.0 if case.answer in answer_text else 0.0
