"""Scheduler-side decisions for one request: which chunks to load, which tokens to recompute,
which chunks to save. Pure functions over spans and store answers; no vLLM, no tensors.

vLLM's scheduler only understands "the next N tokens after the local prefix hit are external".
Chunk reuse is expressed that way: the request claims ``[local, claim_end)`` as external, where
``claim_end`` is the end of the last chunk the store has, rounded down to a block. Inside the
claim, every token comes from one of three places:

* a **loaded** chunk (stored KV, keys re-rotated to the new positions);
* **recompute**: tokens the connector computes itself before the forward (every token of a
  chunk the store lacks, plus the policy's choice: EPIC's first ``k`` tokens of each loaded
  chunk, CacheBlend's most-deviating tokens, chosen on the worker at layer 1, or the tokens the
  question reads most, chosen on the worker by probing the pages with it: ``windows_by_rank``);
* the local prefix hit below ``local`` (vLLM's own exact KV), untouched.

Everything from ``claim_end`` on (the question, at least one token) is computed by vLLM as usual.
KV in the claim is approximate from the first chunk that is not at its original place and
context, so those blocks are re-hashed off vLLM's exact prefix-hash chain (:func:`approx_start`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_accel.kv_connector.chunking import Span


@dataclass(frozen=True)
class PlannedChunk:
    span: Span
    key: str
    stored: bool  # the store had it when the request was planned


@dataclass(frozen=True)
class ChunkLoad:
    """Write ``count`` tokens of stored chunk ``key`` from its token ``offset`` at ``position``."""
    key: str
    position: int
    offset: int
    count: int
    chunk_start: int  # where the chunk starts in this prompt (the re-rotation target)


@dataclass
class ReusePlan:
    chunks: list[PlannedChunk]
    local: int  # vLLM's block-aligned local prefix hit
    claim_end: int  # tokens [local, claim_end) are external (claim_end == local: no reuse)
    loads: list[ChunkLoad] = field(default_factory=list)
    forced: list[int] = field(default_factory=list)  # claimed positions without stored KV
    epic: list[int] = field(default_factory=list)  # EPIC's recompute positions
    candidates: list[int] = field(default_factory=list)  # loaded, approximate positions

    @property
    def num_external(self) -> int:
        return self.claim_end - self.local

    @property
    def loaded_tokens(self) -> int:
        return sum(load.count for load in self.loads)


def plan_reuse(chunks: list[PlannedChunk], prompt_len: int, local: int, block_size: int,
               min_reuse_tokens: int, epic_tokens: int) -> ReusePlan:
    """The claim for one request (``local`` is vLLM's block-aligned local prefix hit)."""
    stored_ends = [c.span.end for c in chunks if c.stored]
    limit = prompt_len - 1  # vLLM must compute at least one prompt token
    claim_end = min(max(stored_ends, default=0), limit)
    claim_end -= claim_end % block_size
    plan = ReusePlan(chunks=chunks, local=local, claim_end=max(claim_end, local))
    if plan.claim_end <= local:
        return plan
    for chunk in chunks:
        start, end = max(chunk.span.start, local), min(chunk.span.end, plan.claim_end)
        if start >= end:
            continue
        if not chunk.stored:
            plan.forced.extend(range(start, end))
            continue
        plan.loads.append(ChunkLoad(chunk.key, start, start - chunk.span.start, end - start,
                                    chunk.span.start))
        if chunk.span.start == 0:
            continue  # a chunk at position 0 saw exactly this context when it was saved
        plan.candidates.extend(range(start, end))
        plan.epic.extend(range(start, min(end, chunk.span.start + epic_tokens)))
    if plan.loaded_tokens < min_reuse_tokens:
        return ReusePlan(chunks=chunks, local=local, claim_end=local)
    return plan


def approx_start(plan: ReusePlan) -> int | None:
    """First position whose KV may differ from a full recompute (``None``: all exact)."""
    approximate = plan.candidates[:1] + plan.forced[:1]
    return min(approximate) if approximate else None


def chunks_to_save(chunks: list[PlannedChunk], saved: set[str],
                   computed_after_step: int) -> list[PlannedChunk]:
    """Chunks the store lacks whose KV is complete once this step has run (claimed tokens count
    as computed: they are loaded or recomputed before the forward). ``saved``: keys already
    saved or planned for this request."""
    return [c for c in chunks
            if not c.stored and c.key not in saved and c.span.end <= computed_after_step]


def windows_by_rank(ranked: list[int], allowed: set[int], budget: int, window: int,
                    after: int | None = None) -> list[int]:
    """``recompute=query``'s choice: walk ``ranked`` (positions, best first) and take each with
    its ``window`` neighbours before it and ``after`` (default ``window``) after it, keeping
    only ``allowed`` positions, until ``budget`` positions are taken (the last window may be
    cut, nearest neighbours first). A token's neighbours carry the phrase it belongs to, so a
    sharply read token is recomputed with its context."""
    after = window if after is None else after
    chosen: set[int] = set()
    for seed in ranked:
        if len(chosen) >= budget:
            break
        if seed in chosen:
            continue
        for p in sorted(range(seed - window, seed + after + 1), key=lambda p: abs(p - seed)):
            if p in allowed and p not in chosen and len(chosen) < budget:
                chosen.add(p)
    return sorted(chosen)
