"""The SPEED visibility rules and the block ranges derived from them."""

from __future__ import annotations

import pytest

from vllm_accel.speed.policy import (
    is_upper_active,
    skipped_block_range,
    skipped_prompt_range,
    upper_prompt_positions,
    upper_visible,
)


@pytest.mark.parametrize("prompt_len, anchor, expected", [
    (10, 1, [0, 9]),
    (10, 3, [0, 1, 2, 9]),
    (3, 3, [0, 1, 2]),       # the last prompt token is an anchor
    (2, 5, [0, 1]),          # prompt shorter than the anchor
    (1, 1, [0]),
])
def test_upper_prompt_positions(prompt_len, anchor, expected):
    assert upper_prompt_positions(prompt_len, anchor) == expected
    assert [p for p in range(prompt_len) if is_upper_active(p, prompt_len, anchor)] == expected


def test_visibility_is_anchor_plus_tail_and_causal():
    # Prompt of 6, anchor 2: upper-active 0, 1, 5, and every decode token 6, 7, ...
    seen = [k for k in range(10) if upper_visible(7, k, prompt_len=6, anchor_tokens=2)]
    assert seen == [0, 1, 5, 6, 7]
    assert [k for k in range(10) if upper_visible(5, k, 6, 2)] == [0, 1, 5]
    assert not upper_visible(1, 5, 6, 2)  # causal


@pytest.mark.parametrize("prompt_len, anchor, rng", [
    (1000, 1, (1, 999)), (10, 3, (3, 9)), (3, 3, (2, 2)), (2, 5, (1, 1)),
])
def test_skipped_prompt_range(prompt_len, anchor, rng):
    assert skipped_prompt_range(prompt_len, anchor) == rng


@pytest.mark.parametrize("prompt_len, anchor, block_size, blocks", [
    (1000, 1, 16, (1, 62)),
    (1000, 16, 16, (1, 62)),
    (1000, 17, 16, (2, 62)),
    (20, 1, 16, (1, 1)),     # last token in block 1: nothing skipped
    (33, 1, 16, (1, 2)),     # last token 32 opens block 2; block 1 is skipped
    (5, 1, 16, (1, 1)),
])
def test_skipped_block_range(prompt_len, anchor, block_size, blocks):
    assert skipped_block_range(prompt_len, anchor, block_size) == blocks
    first, last = blocks
    for b in range(first, last):  # every position of a skipped block is skipped
        assert not any(is_upper_active(p, prompt_len, anchor)
                       for p in range(b * block_size, (b + 1) * block_size))


@pytest.mark.parametrize("args", [(0, 1), (5, 0)])
def test_bad_arguments(args):
    with pytest.raises(ValueError):
        upper_prompt_positions(*args)
