"""A reversible word-level tokenizer and made-up essays: chunk-reuse workloads without a model."""

from __future__ import annotations

import re

_PIECES = re.compile(r"<file_sep>|\s+|[^\s<]+|<")


class FakeTokenizer:
    """Words, whitespace runs and ``<file_sep>`` (one special token) are tokens; ids are given in
    order of first sight, so encode/decode are exact inverses."""

    chat_template = None
    eos_token_id = 0

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {"</s>": 0, "<file_sep>": 1}
        self.inverse = {i: t for t, i in self.vocab.items()}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for piece in _PIECES.findall(text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.vocab)
                self.inverse[self.vocab[piece]] = piece
            ids.append(self.vocab[piece])
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.inverse[i] for i in ids
                       if not (skip_special_tokens and i in (0, 1)))


def fake_essays(count: int = 12, sentences: int = 120) -> dict[str, str]:
    """``count`` essays (plus the held-out ``gba.txt``), each ``sentences`` sentences long."""
    essays = {f"essay{k:02d}.txt": " ".join(f"Essay {k} makes point number {i} here."
                                            for i in range(sentences))
              for k in range(count)}
    essays["gba.txt"] = " ".join(f"Held out sentence {i}." for i in range(sentences))
    return essays
