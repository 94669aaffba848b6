"""The token-recycling adjacency table: each token's most likely successors, per the target.

Token Recycling (Luo et al., ACL 2025, arXiv 2408.08696) observes that the target model
computes a full next-token distribution at every position it verifies, and that its top
candidates are good guesses for what follows the same token later, in any request. The table
keeps, for every token id, the top-k successors from the most recent logits row whose input
token was that id (the newest observation replaces the row, as in the paper). A draft is a
chain: the first successor of the last token, then the first successor of that, and so on.

The table is per vocabulary, not per request, and bounded: an int32 ``[vocab, k]`` array
(-1 = not seen yet). This module is plain numpy: no vLLM, no torch.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

UNSEEN = -1


class RecyclingTableError(ValueError):
    """A hot-start table file that cannot be used (corrupt, other vocabulary or width)."""


class RecyclingTable:
    """``vocab_size`` rows of ``k`` successor token ids."""

    def __init__(self, vocab_size: int, k: int) -> None:
        if vocab_size < 1 or k < 1:
            raise ValueError(f"RecyclingTable needs vocab_size >= 1 and k >= 1, got "
                             f"{vocab_size}, {k}")
        self.vocab_size = vocab_size
        self.k = k
        self.successors = np.full((vocab_size, k), UNSEEN, dtype=np.int32)

    @property
    def num_seen(self) -> int:
        """Tokens whose successors have been observed at least once."""
        return int((self.successors[:, 0] != UNSEEN).sum())

    def update(self, tokens: np.ndarray, topk: np.ndarray) -> None:
        """Row ``i`` of ``topk`` (``[n, >= 1]`` successor ids, most likely first) becomes the
        successors of ``tokens[i]``. Ids outside the vocabulary are ignored (padded logits);
        when a token appears twice, its last row wins."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        topk = np.asarray(topk, dtype=np.int64)
        if topk.ndim != 2 or topk.shape[0] != tokens.shape[0]:
            raise ValueError(f"topk must be [len(tokens), k], got {topk.shape} for "
                             f"{tokens.shape[0]} tokens")
        width = min(self.k, topk.shape[1])
        keep = (tokens >= 0) & (tokens < self.vocab_size)
        rows = topk[keep, :width]
        rows = np.where((rows >= 0) & (rows < self.vocab_size), rows, UNSEEN)
        self.successors[tokens[keep], :width] = rows
        if width < self.k:
            self.successors[tokens[keep], width:] = UNSEEN

    def chain(self, token: int, length: int) -> list[int]:
        """Up to ``length`` tokens following ``token``, each its predecessor's first successor
        (stops at a token never observed)."""
        draft: list[int] = []
        first = self.successors[:, 0]
        while len(draft) < length and 0 <= token < self.vocab_size:
            token = int(first[token])
            if token == UNSEEN:
                break
            draft.append(token)
        return draft

    # ------------------------------------------------------------------ hot start

    def save(self, path: str | os.PathLike) -> None:
        """Write the table to ``path`` (``.npy``), atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, self.successors, allow_pickle=False)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike, vocab_size: int, k: int) -> RecyclingTable:
        """A table from a file :meth:`save` wrote, checked against the vocabulary and k."""
        try:
            data = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise RecyclingTableError(f"recycling table {path}: not a table file ({exc})") \
                from None
        if data.dtype != np.int32 or data.ndim != 2:
            raise RecyclingTableError(f"recycling table {path}: expected an int32 [vocab, k] "
                                      f"array, found {data.dtype} {list(data.shape)}")
        if data.shape != (vocab_size, k):
            raise RecyclingTableError(
                f"recycling table {path} is [{data.shape[0]}, {data.shape[1]}] but this model "
                f"needs [{vocab_size}, {k}] (another model's vocabulary, or another "
                f"recycling_topk); delete it or point recycling_table elsewhere")
        if ((data < UNSEEN) | (data >= vocab_size)).any():
            raise RecyclingTableError(f"recycling table {path}: token ids outside the "
                                      f"vocabulary (corrupt file)")
        table = cls(vocab_size, k)
        table.successors[:] = data
        return table
