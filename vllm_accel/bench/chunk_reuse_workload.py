"""Multi-document QA prompts for the chunk-reuse benchmark (``bench chunk-reuse``).

Documents are ~``chunk_tokens``-token slices of the haystack Paul Graham essays
(:mod:`vllm_accel.quality.data`; the held-out essays are not used), each from its own essay and
each carrying one inserted synthetic fact, "The access code of the Kavoren archive is 4821.",
with invented archive names and 4-digit codes from a seeded RNG. A question needs one document
("What is the access code of the Kavoren archive?") or two (both codes).

Every prompt follows the chunk connector's layout (:mod:`vllm_accel.kv_connector.chunking`)::

    [chat prefix: system turn, user turn opened] SEP doc_a SEP doc_b ... SEP doc_k SEP
    [question, user turn closed, assistant turn opened, answer primer]

so each ``SEP doc`` is a reusable chunk and the question is always computed. Prompts are token
ids: a document's ids are the same in every prompt, whatever its position. The warm-up prompts
present each document once (``prefix SEP doc SEP`` + the chat suffix); the measured prompts put
``num_chunks`` documents in a new shuffled order. Everything is deterministic for a seed: the
questions of one document count come from their own RNG, so adding a count leaves the others'
questions unchanged.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_accel.quality import data

SYSTEM = ("You answer questions about the documents the user gives you. Reply with the "
          "requested numbers only.")
_SYLLABLES = ("ka", "lo", "mi", "ren", "tor", "vas", "zel", "dun", "bri", "sha", "nor", "quel",
              "fa", "gor", "pim", "wex", "ta", "ul", "ven", "dro")
_PLACEHOLDER = "\x00USER\x00"
_SENTENCE_START = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Document:
    archive: str  # the invented archive name in its fact
    code: str  # its 4-digit access code
    essay: str  # the essay file the slice comes from
    text: str  # the slice, fact inserted
    token_ids: tuple[int, ...]  # the document's tokens (without the separator)


@dataclass(frozen=True)
class Question:
    num_chunks: int
    order: tuple[int, ...]  # document indices, in prompt order
    targets: tuple[int, ...]  # the documents the answer needs (1 or 2)
    text: str
    expected: tuple[str, ...]  # the codes the answer must contain
    prompt: tuple[int, ...]


@dataclass(frozen=True)
class Workload:
    separator: str
    separator_id: int
    documents: tuple[Document, ...]
    warmup: tuple[tuple[int, ...], ...]  # one prompt per document
    questions: tuple[Question, ...]

    @property
    def max_prompt_tokens(self) -> int:
        return max(len(p) for p in [*self.warmup, *(q.prompt for q in self.questions)])

    def by_num_chunks(self) -> dict[int, list[Question]]:
        out: dict[int, list[Question]] = {}
        for q in self.questions:
            out.setdefault(q.num_chunks, []).append(q)
        return out


def fact(archive: str, code: str) -> str:
    return f"The access code of the {archive} archive is {code}."


def question_text(archives: Sequence[str]) -> str:
    if len(archives) == 1:
        return f"What is the access code of the {archives[0]} archive?"
    return (f"What are the access codes of the {archives[0]} archive and of the {archives[1]} "
            f"archive?")


def answer_primer(archives: Sequence[str]) -> str:
    """The start of the assistant's answer, so that a small model goes straight to the code."""
    if len(archives) == 1:
        return f"The access code of the {archives[0]} archive is"
    return f"The access codes of the {archives[0]} and {archives[1]} archives are"


def archive_names(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct invented names of three syllables (e.g. ``Kavoren``); while there are
    enough syllables, no two names share their first or last syllable, so that a small model
    does not confuse them."""
    names: list[str] = []
    firsts: set[str] = set()
    lasts: set[str] = set()
    distinct_ends = count <= len(_SYLLABLES)
    while len(names) < count:
        parts = [rng.choice(_SYLLABLES) for _ in range(3)]
        name = "".join(parts).capitalize()
        if name in names or (distinct_ends and (parts[0] in firsts or parts[-1] in lasts)):
            continue
        names.append(name)
        firsts.add(parts[0])
        lasts.add(parts[-1])
    return names


def access_codes(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct 4-digit codes, 3000-9999 (not a plausible year of the essays)."""
    return [str(c) for c in rng.sample(range(3000, 10000), count)]


def insert_fact(text: str, sentence: str, rng: random.Random) -> str:
    """``text`` with ``sentence`` inserted at a sentence start between 20% and 80% of it."""
    starts = [m.end() for m in _SENTENCE_START.finditer(text)
              if 0.2 * len(text) <= m.end() <= 0.8 * len(text)]
    if not starts:  # no sentence boundary in the middle: put it at the middle word break
        middle = text.find(" ", len(text) // 2)
        cut = middle + 1 if middle != -1 else len(text)
        return f"{text[:cut]}{sentence} {text[cut:]}"
    at = rng.choice(starts)
    return f"{text[:at]}{sentence} {text[at:]}"


def whole_sentences(text: str) -> str:
    """``text`` without the partial sentences a token slice cuts at its two ends."""
    first = _SENTENCE_START.search(text)
    if first is not None and first.end() < len(text) // 4:
        text = text[first.end():]
    ends = [m.start() for m in _SENTENCE_START.finditer(text)]
    if ends and ends[-1] > 3 * len(text) // 4:
        text = text[:ends[-1]]
    return text.strip()


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def essay_slices(tokenizer: Any, essays: dict[str, str], count: int, chunk_tokens: int,
                 rng: random.Random) -> list[tuple[str, str]]:
    """``count`` (essay name, text) slices of about ``chunk_tokens`` tokens, one per essay, from
    essays in a seeded order; the held-out essays are skipped."""
    names = sorted(n for n in essays if n not in data.HELDOUT)
    rng.shuffle(names)
    slices: list[tuple[str, str]] = []
    for name in names:
        ids = _encode(tokenizer, essays[name])
        if len(ids) < chunk_tokens + 32:
            continue
        start = rng.randrange(0, len(ids) - chunk_tokens + 1)
        slices.append((name, whole_sentences(tokenizer.decode(ids[start:start + chunk_tokens]))))
        if len(slices) == count:
            return slices
    raise ValueError(f"only {len(slices)} haystack essays have {chunk_tokens + 32} tokens; "
                     f"{count} documents of {chunk_tokens} tokens were asked for (lower "
                     f"num_chunks or chunk_tokens)")


def chat_frame(tokenizer: Any, system: str = SYSTEM) -> tuple[str, str]:
    """(text before the user's content, text between the user's content and the answer): the
    model's chat template around a user turn, or plain text without one."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": _PLACEHOLDER}],
            add_generation_prompt=True, tokenize=False)
        before, found, after = text.partition(_PLACEHOLDER)
        if found:
            return before, after
    return f"{system}\n\n", "\n\nAnswer: "


def layout(prefix: Sequence[int], separator_id: int, documents: Iterable[Sequence[int]],
           tail: Sequence[int]) -> list[int]:
    """``prefix SEP doc_1 SEP doc_2 ... SEP doc_k SEP tail``: every document is a chunk, the tail
    (the question) is computed."""
    ids = list(prefix)
    for doc in documents:
        ids += [separator_id, *doc]
    return ids + [separator_id, *tail]


def build_documents(tokenizer: Any, count: int, chunk_tokens: int, seed: int,
                    essays: dict[str, str] | None = None) -> list[Document]:
    rng = random.Random(f"chunk-reuse-documents-{seed}-{chunk_tokens}")
    essays = data.essays() if essays is None else essays
    archives = archive_names(rng, count)
    codes = access_codes(rng, count)
    documents = []
    for (essay, text), archive, code in zip(essay_slices(tokenizer, essays, count, chunk_tokens,
                                                         rng), archives, codes):
        text = insert_fact(text, fact(archive, code), rng)
        documents.append(Document(archive, code, essay, text,
                                  tuple(_encode(tokenizer, f"\n{text}\n"))))
    return documents


def build(tokenizer: Any, num_chunks: Sequence[int], chunk_tokens: int, questions: int,
          two_doc_questions: int, seed: int = 0, separator: str = "auto",
          essays: dict[str, str] | None = None) -> Workload:
    """The documents (``max(num_chunks)`` of them), one warm-up prompt per document, and
    ``questions`` measured prompts per document count (``two_doc_questions`` of them need two
    documents)."""
    from vllm_accel.kv_connector.separator import separator_from_tokenizer

    separator_id = separator_from_tokenizer(tokenizer, separator)
    separator_text = tokenizer.decode([separator_id])
    documents = build_documents(tokenizer, max(num_chunks), chunk_tokens, seed, essays)
    for doc in documents:
        if separator_id in doc.token_ids:
            raise ValueError(f"essay {doc.essay}: its slice contains the separator token")
    before, after = chat_frame(tokenizer)
    prefix = _encode(tokenizer, before)
    warmup = tuple(tuple(layout(prefix, separator_id, [doc.token_ids], _encode(tokenizer, after)))
                   for doc in documents)
    measured = []
    for n in num_chunks:
        rng = random.Random(f"chunk-reuse-questions-{seed}-{n}")
        two_doc = set(rng.sample(range(questions), min(two_doc_questions, questions))
                      if n >= 2 else [])
        for i in range(questions):
            order = tuple(rng.sample(range(len(documents)), n))
            targets = tuple(rng.sample(order, 2 if i in two_doc else 1))
            archives = [documents[t].archive for t in targets]
            text = question_text(archives)
            tail = _encode(tokenizer, f"Question: {text}{after}{answer_primer(archives)}")
            prompt = layout(prefix, separator_id, [documents[d].token_ids for d in order], tail)
            measured.append(Question(n, order, targets, text,
                                     tuple(documents[t].code for t in targets), tuple(prompt)))
    return Workload(separator_text, separator_id, tuple(documents), warmup, tuple(measured))


def score(expected: Sequence[str], output: str) -> bool:
    """The answer is right when every expected code appears in it as a whole number."""
    numbers = set(re.findall(r"\d+", output))
    return all(code in numbers for code in expected)
