"""SPEED's upper-layer KV-cache group: its spec and the block manager that skips prompt blocks.

In the upper layers only the anchor tokens, each request's last prompt token and the decode
tokens have KV (:mod:`vllm_accel.speed.policy`). Giving those layers their own KV-cache group
lets vLLM's own block accounting show the saving: :class:`SpeedUpperManager` maps every block
that holds only skipped prompt positions to vLLM's shared ``null_block`` (the way RSWA and
sliding-window managers do) and never takes memory for it, so a 1000-token prompt with block size
16 and a 1-token anchor holds 2 real blocks in this group instead of 63, and the scheduler admits
more concurrent requests.

* :class:`SpeedUpperSpec` subclasses ``AttentionSpec``, **not** ``FullAttentionSpec``:
  ``FullAttentionSpec.merge`` accepts subclasses, so a full-attention subclass would be folded
  silently into the lower layers' group and get no manager of its own.
* Prompt length. The manager learns each request's prompt length from
  ``remove_skipped_blocks(..., num_prompt_tokens=...)``, which ``KVCacheManager.allocate_slots``
  calls before every ``get_num_blocks_to_allocate`` / ``allocate_new_blocks`` of a step
  (``v1/core/kv_cache_manager.py``), and keeps it while the request holds blocks, then in a
  bounded memory of freed requests so a preempted request is still known when it comes back.
  The one count made before the length is recorded is the admission check of a *waiting*
  request (``full_sequence_must_fit``, on by default): there the coordinator passes
  ``prefill_end=0`` and ``num_tokens`` = the request's whole sequence, which for a request never
  seen is its prompt, so the manager takes ``num_tokens`` as the prompt length (exact; any
  smaller ``num_tokens`` only makes the count larger, i.e. conservative). Only a preempted
  request already forgotten would be counted a few decode blocks short, and the step's own
  allocation check, made with the recorded length, still refuses what does not fit.
* Prefix caching: this group never reports a hit (``find_longest_cache_hit`` returns nothing),
  so with prefix caching on, the hybrid coordinator's reconciled hit is 0 and every request is
  recomputed in full. That is the safe choice for now: reporting ``[anchor block] + null blocks``
  would let a request skip recomputing its anchor's upper-layer KV and read another request's
  anchor block, whose other slots hold that request's last-prompt/decode KV; that is correct
  only if the upper-layer attention masks ``[anchor, prompt_len - 1)`` by the prompt length,
  which the backend does not do yet. Marking the spec not prefix-cacheable instead would be
  wrong: the coordinator would then skip this group in the lookup and hand the *lower* group's
  hit to every group, so the anchor's upper-layer KV would never be computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from vllm_accel.speed.policy import skipped_block_range

#: Prompt lengths of freed (finished or preempted) requests kept for a comeback.
FREED_PROMPT_LENS = 65536


@dataclass(frozen=True, kw_only=True)
class SpeedUpperSpec(AttentionSpec):
    """KV cache of SPEED's upper layers: anchors + last prompt token + decode tokens."""

    #: Leading prompt positions whose KV the upper layers keep (the ``speed.anchor_tokens`` knob).
    anchor_tokens: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.anchor_tokens < 1:
            raise ValueError(f"anchor_tokens must be >= 1, got {self.anchor_tokens}")

    def max_memory_usage_bytes(self, vllm_config) -> int:
        # Worst case: a one-token prompt decoded to max_model_len, every block real.
        return cdiv(vllm_config.model_config.max_model_len, self.block_size) * self.page_size_bytes


class SpeedUpperManager(FullAttentionManager):
    """Full-attention block manager whose skipped prompt blocks are ``null_block``.

    Block ``i`` of a request is skipped when it holds only prompt positions in
    ``[anchor_tokens, prompt_len - 1)``; it is never allocated (or, if it was allocated before the
    prompt length was known, it is returned once processed). Everything else -- the anchor
    block(s), the block of the last prompt token and every decode block -- is real.
    """

    supports_fine_grained_hash_lookup = False

    def __init__(self, kv_cache_spec: SpeedUpperSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.anchor_tokens: int = kv_cache_spec.anchor_tokens
        self._prompt_lens: dict[str, int] = {}
        self._freed_prompt_lens: OrderedDict[str, int] = OrderedDict()

    # -- which blocks are skipped -------------------------------------------------------------

    def prompt_len(self, request_id: str) -> int | None:
        """The recorded prompt length of ``request_id`` (live or recently freed), if any."""
        return self._prompt_lens.get(request_id, self._freed_prompt_lens.get(request_id))

    def skipped_blocks(self, request_id: str, prompt_len: int | None = None) -> range:
        """Block indices of ``request_id`` that get no memory.

        Uses the recorded prompt length, else ``prompt_len``; empty when neither is known.
        """
        prompt_len = self.prompt_len(request_id) or prompt_len
        if not prompt_len:
            return range(0)
        return range(*skipped_block_range(prompt_len, self.anchor_tokens, self.block_size))

    def _num_real_blocks(self, skipped: range, start: int, end: int) -> int:
        overlap = max(0, min(end, skipped.stop) - max(start, skipped.start))
        return max(0, end - start) - overlap

    def _extend(self, request_id: str, num_blocks: int, record: bool) -> list[KVCacheBlock]:
        """Grow the request's block list to ``num_blocks``: nulls in the skipped range.

        Returns every appended entry, null blocks included: the scheduler sends these ids to
        the worker, which appends them to its block table, so a table without the nulls would
        shift every later block to the wrong position (and the tail would land in the null
        block, shared by all requests)."""
        req_blocks = self.req_to_blocks[request_id]
        start = len(req_blocks)
        if num_blocks <= start:
            return []
        skipped = self.skipped_blocks(request_id)
        new = self.block_pool.get_new_blocks(self._num_real_blocks(skipped, start, num_blocks))
        fresh = iter(new)
        appended = [self._null_block if i in skipped else next(fresh)
                    for i in range(start, num_blocks)]
        req_blocks.extend(appended)
        if record and self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new)
        return appended

    # -- SingleTypeKVCacheManager hooks --------------------------------------------------------

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        # This group never reports prefix-cache hits (see find_longest_cache_hit).
        assert not new_computed_blocks, "SPEED upper group got prefix-cache blocks"
        start = len(self.req_to_blocks.get(request_id, ()))
        # Unrecorded length: the admission check of a new request, whose num_tokens is its
        # prompt (see the module docstring).
        skipped = self.skipped_blocks(request_id, prompt_len=prefill_end or num_tokens)
        return self._num_real_blocks(skipped, start, cdiv(num_tokens, self.block_size))

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        return self._extend(request_id, cdiv(num_tokens, self.block_size), record=True)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        if num_external_computed_tokens <= 0:
            return
        total = num_local_computed_tokens + num_external_computed_tokens
        self._extend(request_id, cdiv(total, self.block_size), record=record_for_zeroing)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens:
            self._prompt_lens[request_id] = num_prompt_tokens
            self._freed_prompt_lens.pop(request_id, None)
        skipped = self.skipped_blocks(request_id)
        # Normally a no-op (skipped blocks were never allocated); returns real blocks in the
        # skipped range that were allocated before the prompt length was known, once processed.
        last = min(skipped.stop, processed_computed_tokens // self.block_size)
        self._remove_blocks_in_range(request_id, skipped.start, last)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        prompt_len = self._prompt_lens.pop(request_id, None)
        if prompt_len:
            self._freed_prompt_lens[request_id] = prompt_len
            while len(self._freed_prompt_lens) > FREED_PROMPT_LENS:
                self._freed_prompt_lens.popitem(last=False)
        return super().pop_blocks_for_free(request_id)

    def cache_blocks(self, request, num_tokens: int, retention_interval: int | None = None, *,
                     replay_boundaries: Sequence[int]) -> None:
        # Nothing is hashed (no hit is ever served), but keep the per-request "cached block"
        # count that the coordinator reads to tell running requests from new ones.
        # Same bookkeeping as the base class, which records only once a block is full.
        num_full_blocks = num_tokens // self.block_size
        if num_full_blocks > self.num_cached_block.get(request.request_id, 0):
            self.num_cached_block[request.request_id] = num_full_blocks

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length: int, kv_cache_group_ids: list[int],
                               block_pool, kv_cache_spec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1):
        # No hit: see the module docstring for why this is the safe choice.
        return tuple([] for _ in kv_cache_group_ids), 0


def register_speed_kv_spec() -> None:
    """Register :class:`SpeedUpperSpec` with its manager in this process (idempotent).

    vLLM's built-in specs are registered first: ``KVCacheSpecRegistry._ensure_registered`` does
    nothing once the registry is non-empty, so registering ours first would leave the built-in
    specs (full attention included) without managers.
    """
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(SpeedUpperSpec, SpeedUpperManager,
                                 uniform_type_base_spec=SpeedUpperSpec)
