"""Training prompts for SPEED adaptation, built offline and kept apart from every evaluation set.

Three kinds, mixed (:class:`DataPlan` fractions):

* ``retrieval`` -- one to four "access code" facts hidden at random depths of essay text, one
  asked for through the chat template. The continuation is the dense model's own greedy answer
  (self-distillation: the student learns to answer what the teacher answers). Keys, fact and
  question wording differ from the evaluation's needle / multi-key tasks
  (:mod:`vllm_accel.quality.needle`: "special magic number for <city>"), so no evaluation prompt
  is seen in training.
* ``essay`` -- a window of the haystack essays (:func:`vllm_accel.quality.data.haystack_text`;
  the held-out essays that perplexity is measured on are excluded) split into a prompt and the
  real continuation.
* ``code`` -- the same with Python standard-library sources; files are split by a hash of their
  name, and the evaluation's code task uses only the other split (:func:`code_files`).

Everything here is deterministic in ``seed``, so an interrupted run rebuilds the same examples.
"""

from __future__ import annotations

import random
import sysconfig
import zlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from vllm_accel.quality import data
from vllm_accel.quality.prompts import chat_ids, haystack, insert_at_depths

KINDS = ("retrieval", "essay", "code")

_ADJECTIVES = ("amber", "silver", "northern", "quiet", "crimson", "hollow", "frozen", "golden",
               "eastern", "velvet", "iron", "misty", "copper", "hidden", "lunar", "coral")
_NOUNS = ("locker", "archive", "garden", "harbor", "tower", "vault", "orchard", "cabin",
          "station", "library", "bridge", "canal", "market", "studio", "reactor", "chapel")
_FACTS = ("The access code for the {key} is {value}.",
          "Remember this: the {key} opens with the code {value}.",
          "Note that the code of the {key} is {value}.")
_QUESTIONS = ("\n\nWhat is the access code for the {key}? Reply with the code only.",
              "\n\nWhich code opens the {key}, according to the text? Give just the code.")


@dataclass(frozen=True)
class DataPlan:
    examples: int = 320
    min_prompt_tokens: int = 256
    max_prompt_tokens: int = 1024
    continuation_tokens: int = 32  # essay / code; retrieval answers are the teacher's own
    fractions: tuple[float, float, float] = (0.5, 0.3, 0.2)  # retrieval, essay, code
    seed: int = 0

    def validate(self) -> None:
        if self.examples < 2:
            raise ValueError(f"--examples must be >= 2, got {self.examples}")
        if not 16 <= self.min_prompt_tokens <= self.max_prompt_tokens:
            raise ValueError(f"prompt lengths must satisfy 16 <= --min-prompt-tokens <= "
                             f"--max-prompt-tokens, got {self.min_prompt_tokens}.."
                             f"{self.max_prompt_tokens}")
        if len(self.fractions) != len(KINDS) or any(f < 0 for f in self.fractions) \
                or sum(self.fractions) <= 0:
            raise ValueError(f"fractions of {KINDS} must be 3 non-negative numbers, got "
                             f"{self.fractions}")


@dataclass(frozen=True)
class Example:
    kind: str
    prompt_ids: tuple[int, ...]
    #: Teacher-forced continuation; None: the dense teacher's greedy answer (generated later).
    continuation_ids: tuple[int, ...] | None


def _train_keys() -> list[str]:
    return [f"{a} {n}" for a in _ADJECTIVES for n in _NOUNS]


def _access_code(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2)) + str(
        rng.randrange(1000, 10000))


def _retrieval(tokenizer, length: int, rng: random.Random) -> Example:
    keys = rng.sample(_train_keys(), rng.randint(1, 4))
    values = [_access_code(rng) for _ in keys]
    facts = [(rng.random(), rng.choice(_FACTS).format(key=k, value=v))
             for k, v in zip(keys, values)]
    question = rng.choice(_QUESTIONS).format(key=rng.choice(keys))
    extra = len(chat_ids(tokenizer, " ".join(f for _, f in facts) + question))
    text = insert_at_depths(haystack(tokenizer, max(16, length - extra), rng), facts)
    return Example("retrieval", tuple(chat_ids(tokenizer, text + question)), None)


def _window(ids: tuple[int, ...], length: int, cont: int, rng: random.Random,
            bos: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    start = rng.randrange(0, len(ids) - length - cont + 1)
    prompt = tuple(bos) + ids[start : start + length - len(bos)]
    end = start + length - len(bos)
    return prompt, ids[end : end + cont]


@cache
def _essay_ids(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer(data.haystack_text(), add_special_tokens=False)["input_ids"])


def code_files(split: str) -> list[Path]:
    """Standard-library ``.py`` files of ``split`` ("train" or "eval"), by a hash of the name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4000)
    want_eval = split == "eval"
    return [p for p in files if (zlib.crc32(p.name.encode()) % 5 == 0) == want_eval]


@cache
def _code_ids(tokenizer) -> tuple[int, ...]:
    files = code_files("train")
    if not files:
        raise FileNotFoundError("no Python standard-library sources found for the code data")
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_examples(tokenizer, plan: DataPlan) -> list[Example]:
    """``plan.examples`` training examples, deterministic in ``plan.seed``."""
    plan.validate()
    rng = random.Random(plan.seed)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    total = sum(plan.fractions)
    counts = [round(plan.examples * f / total) for f in plan.fractions]
    counts[0] += plan.examples - sum(counts)
    kinds = [kind for kind, n in zip(KINDS, counts) for _ in range(n)]
    rng.shuffle(kinds)
    examples = []
    for kind in kinds:
        length = rng.randint(plan.min_prompt_tokens, plan.max_prompt_tokens)
        if kind == "retrieval":
            examples.append(_retrieval(tokenizer, length, rng))
            continue
        ids = _essay_ids(tokenizer) if kind == "essay" else _code_ids(tokenizer)
        prompt, cont = _window(ids, length, plan.continuation_tokens, rng, bos)
        examples.append(Example(kind, prompt, cont))
    return examples
