"""SPEED's upper-layer KV group: the manager gives skipped prompt blocks no memory.

Driven two ways: the manager alone with vLLM's BlockPool, in the call order of
``KVCacheManager.allocate_slots``; and vLLM's own ``KVCacheManager`` with two groups (lower layers
full attention, upper layers SPEED), whose block accounting must show the saving.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from vllm_accel.speed.kv_spec import (  # noqa: E402
    SpeedUpperManager,
    SpeedUpperSpec,
    register_speed_kv_spec,
)

BS = 16
POOL = 400


def _spec(anchor=1, block_size=BS):
    return SpeedUpperSpec(block_size=block_size, num_kv_heads=2, head_size=64,
                          dtype=torch.float32, anchor_tokens=anchor)


def _manager(anchor=1, block_size=BS, pool=None):
    pool = pool or BlockPool(num_gpu_blocks=POOL, enable_caching=False, hash_block_size=block_size)
    return SpeedUpperManager(_spec(anchor, block_size), block_pool=pool, enable_caching=False,
                             kv_cache_group_id=1, scheduler_block_size=block_size), pool


def _step(mgr, rid, prompt_len, computed, new_tokens, tell_prompt_len=True):
    """One allocate_slots round for this group: returns (predicted, allocated) real blocks."""
    if tell_prompt_len:
        mgr.remove_skipped_blocks(rid, computed, num_prompt_tokens=prompt_len)
    total = computed + new_tokens
    predicted = mgr.get_num_blocks_to_allocate(rid, total, [], computed, computed, total,
                                               prefill_end=prompt_len if tell_prompt_len else 0)
    before = len(mgr.req_to_blocks[rid])
    allocated = mgr.allocate_new_blocks(rid, total, total)
    # what the worker appends to its block table: positional, nulls included
    assert allocated == mgr.req_to_blocks[rid][before:]
    return predicted, len(_real(allocated))


def _real(blocks):
    return [b for b in blocks if not b.is_null]


def test_1000_token_prompt_holds_two_real_blocks_instead_of_63():
    mgr, pool = _manager()
    free0 = pool.get_num_free_blocks()
    assert _step(mgr, "r", 1000, 0, 1000) == (2, 2)
    blocks = mgr.req_to_blocks["r"]
    assert len(blocks) == cdiv(1000, BS) == 63  # the block table still covers every position
    # Block 0 holds the anchor, block 62 (positions 992..1007) the last prompt token.
    assert [i for i, b in enumerate(blocks) if not b.is_null] == [0, 62]
    assert pool.get_num_free_blocks() == free0 - 2
    # The same prompt in a full-attention manager on the same pool takes all 63.
    full = FullAttentionManager(FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64,
                                                  dtype=torch.float32),
                                block_pool=pool, enable_caching=False, kv_cache_group_id=0,
                                scheduler_block_size=BS)
    full.allocate_new_blocks("r", 1000, 1000)
    assert pool.get_num_free_blocks() == free0 - 2 - 63


def test_admission_count_before_the_prompt_length_is_recorded():
    # allocate_slots' full_sequence_must_fit check runs before remove_skipped_blocks, with
    # prefill_end=0 and num_tokens = the whole sequence (= the prompt of a new request).
    mgr, _ = _manager()
    assert mgr.get_num_blocks_to_allocate("new", 1000, [], 0, 0, 1000, prefill_end=0) == 2
    # A smaller num_tokens can only over-count (block 15 holds position 255, the "last").
    assert mgr.get_num_blocks_to_allocate("new", 256, [], 0, 0, 256, prefill_end=0) == 2
    assert "new" not in mgr.req_to_blocks and mgr.prompt_len("new") is None


def test_a_preempted_request_keeps_its_prompt_length():
    mgr, pool = _manager()
    free0 = pool.get_num_free_blocks()
    _step(mgr, "r", 1000, 0, 1000)
    for i in range(40):
        _step(mgr, "r", 1000, 1000 + i, 1)
    mgr.free("r")  # preempted: everything goes back
    assert pool.get_num_free_blocks() == free0 and mgr.prompt_len("r") == 1000
    # Resumed: prompt + 40 outputs recomputed. The admission count (whole sequence of 1040
    # tokens) must use the real prompt (real blocks 0, 62, 63, 64), not 1040.
    assert mgr.get_num_blocks_to_allocate("r", 1040, [], 0, 0, 1040, prefill_end=0) == 4
    assert _step(mgr, "r", 1000, 0, 1040) == (4, 4)


def test_chunked_prefill_then_decode_then_free():
    mgr, pool = _manager()
    free0 = pool.get_num_free_blocks()
    computed = 0
    for chunk in (256, 256, 256, 232):  # 1000-token prompt in four chunks
        predicted, allocated = _step(mgr, "r", 1000, computed, chunk)
        assert predicted == allocated
        computed += chunk
    assert len(_real(mgr.req_to_blocks["r"])) == 2
    # Decode 100 tokens: block 62 has room up to position 1007, then one real block per 16.
    for _ in range(100):
        predicted, allocated = _step(mgr, "r", 1000, computed, 1)
        assert predicted == allocated
        computed += 1
    blocks = mgr.req_to_blocks["r"]
    assert len(blocks) == cdiv(1100, BS) == 69
    assert len(_real(blocks)) == 2 + (69 - 63) == 8
    assert all(not b.is_null for b in blocks[62:])
    assert pool.get_num_free_blocks() == free0 - 8
    mgr.free("r")
    assert pool.get_num_free_blocks() == free0
    assert "r" not in mgr.req_to_blocks


@pytest.mark.parametrize("anchor, block_size, prompt_len, real", [
    (1, 16, 10, [0]),            # short prompt: anchor and last token share block 0
    (1, 16, 17, [0, 1]),         # position 16 is in block 1: nothing to skip
    (1, 16, 50, [0, 3]),         # blocks 1, 2 skipped
    (3, 16, 1000, [0, 62]),      # a 3-token anchor still fits block 0
    (16, 8, 1000, [0, 1, 124]),  # a 16-token anchor spans two 8-token blocks
    (1, 16, 1024, [0, 63]),      # last prompt token (1023) at the end of block 63
    (1, 16, 1025, [0, 64]),      # ... and at the start of block 64
])
def test_which_blocks_are_real(anchor, block_size, prompt_len, real):
    mgr, pool = _manager(anchor, block_size)
    free0 = pool.get_num_free_blocks()
    assert _step(mgr, "r", prompt_len, 0, prompt_len) == (len(real), len(real))
    blocks = mgr.req_to_blocks["r"]
    assert len(blocks) == cdiv(prompt_len, block_size)
    assert [i for i, b in enumerate(blocks) if not b.is_null] == real
    mgr.free("r")
    assert pool.get_num_free_blocks() == free0


def test_blocks_allocated_before_the_prompt_length_is_known_are_returned_once_processed():
    mgr, pool = _manager()
    free0 = pool.get_num_free_blocks()
    # Without a recorded length every allocated block is real (vLLM always records it first).
    assert _step(mgr, "r", 1000, 0, 1000, tell_prompt_len=False)[1] == 63
    mgr.remove_skipped_blocks("r", 500, num_prompt_tokens=1000)  # only processed blocks go
    assert len(_real(mgr.req_to_blocks["r"])) == 63 - (500 // BS - 1)
    mgr.remove_skipped_blocks("r", 1000, num_prompt_tokens=1000)
    assert [i for i, b in enumerate(mgr.req_to_blocks["r"]) if not b.is_null] == [0, 62]
    assert pool.get_num_free_blocks() == free0 - 2
    mgr.free("r")
    assert pool.get_num_free_blocks() == free0


def test_no_prefix_cache_hit_is_ever_reported():
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BS)
    blocks, length = SpeedUpperManager.find_longest_cache_hit(
        block_hashes=[b"h"] * 8, max_length=128, kv_cache_group_ids=[1, 2], block_pool=pool,
        kv_cache_spec=_spec(), drop_eagle_block=False, alignment_tokens=BS)
    assert blocks == ([], []) and length == 0


def test_registration_is_idempotent_and_keeps_the_builtin_specs():
    register_speed_kv_spec()
    register_speed_kv_spec()
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    assert KVCacheSpecRegistry.get_manager_class(_spec()) is SpeedUpperManager
    assert KVCacheSpecRegistry.get_manager_class(full) is FullAttentionManager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(_spec()) is SpeedUpperSpec
    # Not a FullAttentionSpec: it would otherwise merge into the lower layers' group.
    assert not isinstance(_spec(), FullAttentionSpec)
    with pytest.raises(ValueError, match="anchor_tokens"):
        _spec(anchor=0)


# -- through vLLM's KVCacheManager: two groups, one block pool --------------------------------

def _kv_manager(num_blocks, enable_caching=False, speed=True):
    register_speed_kv_spec()
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    upper = SpeedUpperSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32,
                           anchor_tokens=1)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full)]
    if speed:
        groups.append(KVCacheGroupSpec(["model.layers.1.self_attn.attn"], upper))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(config, max_model_len=4096, scheduler_block_size=BS,
                          hash_block_size=BS, enable_caching=enable_caching)


def _request(rid, prompt_len):
    init_none_hash(sha256)
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=64), None,
                   block_hasher=get_request_block_hasher(BS, sha256))


@pytest.mark.parametrize("enable_caching", [False, True])
def test_vllm_kv_cache_manager_accounts_the_saving(enable_caching):
    kvm = _kv_manager(num_blocks=200, enable_caching=enable_caching)
    free0 = kvm.block_pool.get_num_free_blocks()
    req = _request("a", 1000)
    if enable_caching:
        assert kvm.get_computed_blocks(req)[1] == 0
    assert kvm.allocate_slots(req, 1000) is not None
    lower, upper = kvm.get_blocks("a").blocks
    assert len(_real(lower)) == 63 and len(_real(upper)) == 2 and len(upper) == 63
    assert kvm.block_pool.get_num_free_blocks() == free0 - 65  # dense two groups: 126
    kvm.free(req)
    assert kvm.block_pool.get_num_free_blocks() == free0


def test_vllm_admits_a_request_that_would_not_fit_dense():
    # 100 blocks: a 1000-token prompt needs 63 + 63 dense (does not fit), 63 + 2 with SPEED.
    kvm = _kv_manager(num_blocks=100)
    assert kvm.allocate_slots(_request("a", 1000), 1000, full_sequence_must_fit=True) is not None
    assert kvm.allocate_slots(_request("b", 1000), 1000, full_sequence_must_fit=True) is None


@pytest.mark.parametrize("speed, expected_hit", [(False, 992), (True, 0)])
def test_prefix_cache_hit_of_the_lower_group_is_not_used_alone(speed, expected_hit):
    # A second identical prompt hits the full-attention group (62 blocks: the last token is
    # always recomputed); with the SPEED group present, that group reports no hit, so the
    # reconciled hit is 0 and the anchor's upper-layer KV is recomputed, never left unwritten.
    kvm = _kv_manager(num_blocks=300, enable_caching=True, speed=speed)
    first = _request("a", 1000)
    kvm.get_computed_blocks(first)
    assert kvm.allocate_slots(first, 1000) is not None
    assert kvm.get_computed_blocks(_request("b", 1000))[1] == expected_hit


def test_vllm_puts_the_upper_layers_in_a_group_of_their_own():
    # vLLM's own grouping of 6 lower (full) + 2 upper (SPEED) layers: the upper layers are not
    # merged into full attention (as a FullAttentionSpec subclass would be).
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    register_speed_kv_spec()
    config = VllmConfig()
    config.cache_config.kv_cache_layout = "NHD"  # normally resolved by the engine core
    kw = dict(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    specs = {f"model.layers.{i}.self_attn.attn":
             FullAttentionSpec(**kw) if i < 6 else SpeedUpperSpec(**kw, anchor_tokens=1)
             for i in range(8)}
    groups = get_kv_cache_groups(config, specs)
    upper = [g for g in groups if isinstance(g.kv_cache_spec, SpeedUpperSpec)]
    assert len(upper) == 1
    assert upper[0].layer_names == ["model.layers.6.self_attn.attn",
                                    "model.layers.7.self_attn.attn"]
    lower = [name for g in groups if g not in upper for name in g.layer_names]
    assert sorted(lower) == [f"model.layers.{i}.self_attn.attn" for i in range(6)]
