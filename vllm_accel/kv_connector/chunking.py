"""Where the reusable chunks of a prompt are.

A prompt marks its documents with a separator token (one special token, e.g. Qwen2.5's
``<|file_sep|>``)::

    [system prefix] SEP doc_1 SEP doc_2 ... SEP doc_k SEP question

Every segment that starts with a separator and is followed by another separator is a chunk
(separator included: it is the chunk's first token wherever the chunk lands). The system prefix
before the first separator is a chunk too (at position 0 its KV is exact). The last segment (the
question) is never a chunk: it is always computed. A client that cannot use a separator passes
token spans instead, ``kv_transfer_params={"chunk_spans": [[start, end], ...]}``; the tokens
between spans (and before the first) become chunks of their own, so every token before the last
span's end belongs to exactly one chunk. ``kv_transfer_params={"chunk_reuse": false}`` turns reuse
off for one request. This module does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class ChunkMarkupError(ValueError):
    """Malformed chunk markers or ``kv_transfer_params`` (the request's fault, not the server's)."""


@dataclass(frozen=True)
class Span:
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def spans_from_separator(token_ids: Sequence[int], separator_id: int) -> list[Span]:
    """Chunks of a separator-marked prompt (see the module docstring); ``[]`` when the prompt
    has fewer than two separators (nothing between two separators to reuse)."""
    marks = [i for i, t in enumerate(token_ids) if t == separator_id]
    if len(marks) < 2:
        return []
    spans = [Span(0, marks[0])] if marks[0] > 0 else []
    spans += [Span(a, b) for a, b in zip(marks, marks[1:]) if b > a]
    return spans


def spans_from_params(raw: Any, prompt_len: int) -> list[Span]:
    """Chunks from explicit ``chunk_spans``, with the gaps filled by chunks of their own."""
    if not isinstance(raw, (list, tuple)):
        raise ChunkMarkupError("kv_transfer_params.chunk_spans must be a list of [start, end] "
                               "token index pairs")
    spans: list[Span] = []
    previous_end = 0
    for item in raw:
        if (not isinstance(item, (list, tuple)) or len(item) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
            raise ChunkMarkupError(f"kv_transfer_params.chunk_spans: {item!r} is not a "
                                   f"[start, end] pair of token indices")
        start, end = item
        if start < previous_end or end <= start:
            raise ChunkMarkupError(f"kv_transfer_params.chunk_spans: [{start}, {end}] must be "
                                   f"non-empty, sorted and non-overlapping")
        if end > prompt_len - 1:
            raise ChunkMarkupError(f"kv_transfer_params.chunk_spans: [{start}, {end}] reaches "
                                   f"the last prompt token ({prompt_len - 1}); at least one "
                                   f"token after the chunks must be computed")
        if start > previous_end:
            spans.append(Span(previous_end, start))
        spans.append(Span(start, end))
        previous_end = end
    return spans


def find_chunks(token_ids: Sequence[int], separator_id: int | None,
                params: dict[str, Any] | None) -> list[Span]:
    """The chunk spans of one prompt: explicit ``chunk_spans`` win over the separator.

    Raises :class:`ChunkMarkupError` on malformed ``kv_transfer_params``.
    """
    params = params or {}
    if not isinstance(params, dict):
        raise ChunkMarkupError("kv_transfer_params must be a JSON object")
    enabled = params.get("chunk_reuse", True)
    if not isinstance(enabled, bool):
        raise ChunkMarkupError("kv_transfer_params.chunk_reuse must be true or false")
    if not enabled:
        return []
    if "chunk_spans" in params:
        return spans_from_params(params["chunk_spans"], len(token_ids))
    if separator_id is None:
        return []
    return spans_from_separator(token_ids, separator_id)
