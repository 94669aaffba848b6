"""The SPEED visibility policy as plain rules: which tokens run the upper layers, what they see.

SPEED ("shallow prefill, deep decode") splits a model's ``L`` decoder layers at ``num_lower``:

* lower layers (``index < num_lower``) are ordinary causal attention over every token;
* upper layers (``index >= num_lower``) run only for the *upper-active* tokens: the first
  ``anchor_tokens`` prompt positions (the BoS attention sink), the last prompt position
  ``P - 1`` (it produces the first output token) and every decode token. There, a token at
  position ``q`` attends causally to the upper-active positions ``<= q``, i.e. to
  ``{0 .. anchor-1} ∪ {P-1 ..}``.

Prompt tokens that are not upper-active never influence anything visible in the upper layers, so
an implementation may skip their upper-layer compute and KV entirely. These functions are the
single statement of that rule; the PyTorch oracle, the mask reference and the KV-cache manager
all derive from them. No torch or vLLM import.
"""

from __future__ import annotations


def _check(prompt_len: int, anchor_tokens: int) -> None:
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    if anchor_tokens < 1:
        raise ValueError(f"anchor_tokens must be >= 1, got {anchor_tokens}")


def upper_prompt_positions(prompt_len: int, anchor_tokens: int) -> list[int]:
    """Prompt positions that run the upper layers, ascending: the anchors and ``prompt_len-1``."""
    _check(prompt_len, anchor_tokens)
    positions = list(range(min(anchor_tokens, prompt_len)))
    if prompt_len - 1 not in positions:
        positions.append(prompt_len - 1)
    return positions


def upper_positions(total_len: int, prompt_len: int, anchor_tokens: int) -> list[int]:
    """Positions of a ``total_len``-token sequence (a ``prompt_len``-token prompt, then decode
    tokens) that run the upper layers, ascending: the prompt's upper positions, then every
    decode position."""
    if total_len < prompt_len:
        raise ValueError(f"total_len {total_len} < prompt_len {prompt_len}")
    return upper_prompt_positions(prompt_len, anchor_tokens) + list(range(prompt_len, total_len))


def is_upper_active(position: int, prompt_len: int, anchor_tokens: int) -> bool:
    """Whether the token at ``position`` runs the upper layers (decode tokens always do)."""
    _check(prompt_len, anchor_tokens)
    return position < anchor_tokens or position >= prompt_len - 1


def upper_visible(query_pos: int, key_pos: int, prompt_len: int, anchor_tokens: int) -> bool:
    """Whether an upper-layer query at ``query_pos`` attends to the key at ``key_pos``."""
    return key_pos <= query_pos and is_upper_active(key_pos, prompt_len, anchor_tokens)


def skipped_prompt_range(prompt_len: int, anchor_tokens: int) -> tuple[int, int]:
    """Half-open ``[start, end)`` of prompt positions without upper-layer KV (may be empty)."""
    _check(prompt_len, anchor_tokens)
    start = min(anchor_tokens, prompt_len - 1)
    return start, max(start, prompt_len - 1)


def skipped_block_range(prompt_len: int, anchor_tokens: int, block_size: int) -> tuple[int, int]:
    """Half-open ``[first, last)`` of KV blocks that hold only skipped prompt positions.

    These blocks of an upper layer are never written nor read, so they need no memory. The
    blocks before ``first`` hold the anchors; block ``last`` holds the last prompt token, and the
    decode tokens follow it.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    start, end = skipped_prompt_range(prompt_len, anchor_tokens)
    first = -(-start // block_size)  # ceil: a block shared with an anchor is kept
    return first, max(first, end // block_size)
