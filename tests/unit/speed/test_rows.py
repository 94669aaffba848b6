"""The upper-layer row selection of a mixed vLLM batch, against the policy rule per token."""

from __future__ import annotations

import pytest
import torch

from vllm_accel.speed.policy import is_upper_active
from vllm_accel.speed.rows import select_upper_rows, upper_row_mask


def _batch(spans):
    """spans: [(first_position, num_tokens)] per request -> positions, query_start_loc."""
    positions = torch.cat([torch.arange(p, p + n) for p, n in spans])
    qsl = torch.tensor([0] + [n for _, n in spans]).cumsum(0)
    return positions, qsl


def test_mixed_batch():
    # r0: first chunk of a 100-token prompt (positions 0..31); r1: final chunk of a 40-token
    # prompt (32..39); r2: a decode token at 57 (prompt 50); r3: a whole 5-token prompt.
    positions, qsl = _batch([(0, 32), (32, 8), (57, 1), (0, 5)])
    prompt_lens = torch.tensor([100, 40, 50, 5])
    sel = select_upper_rows(positions, qsl, prompt_lens, anchor_tokens=2)
    # r0: anchors 0, 1 -> rows 0, 1. r1: position 39 -> row 39. r2: row 40. r3: positions
    # 0, 1 (anchors) and 4 (last) -> rows 41, 42, 45.
    assert sel.rows.tolist() == [0, 1, 39, 40, 41, 42, 45]
    assert sel.query_start_loc.tolist() == [0, 2, 3, 4, 7]
    assert sel.num_rows == 7


def test_replayed_outputs_of_a_preempted_request_run_the_upper_layers():
    # Prompt of 20 plus 6 outputs recomputed in one chunk: positions 19..25 are upper rows.
    positions, qsl = _batch([(0, 26)])
    sel = select_upper_rows(positions, qsl, torch.tensor([20]), anchor_tokens=1)
    assert sel.rows.tolist() == [0, 19, 20, 21, 22, 23, 24, 25]


def test_padding_rows_and_empty_requests_are_excluded():
    positions, qsl = _batch([(0, 4), (9, 1)])
    padded = torch.cat([positions, torch.zeros(3, dtype=positions.dtype)])
    qsl = torch.cat([qsl[:1], torch.tensor([0]), qsl[1:]])  # an empty request first
    mask = upper_row_mask(padded, qsl, torch.tensor([7, 4, 10]), anchor_tokens=1)
    assert mask.tolist() == [True, False, False, True, True, False, False, False]
    sel = select_upper_rows(padded, qsl, torch.tensor([7, 4, 10]), anchor_tokens=1)
    assert sel.query_start_loc.tolist() == [0, 0, 2, 3]


@pytest.mark.parametrize("seed", range(5))
def test_random_batches_follow_the_policy(seed):
    g = torch.Generator().manual_seed(seed)
    spans, prompt_lens = [], []
    for _ in range(int(torch.randint(1, 8, (1,), generator=g))):
        prompt = int(torch.randint(1, 60, (1,), generator=g))
        start = int(torch.randint(0, prompt + 10, (1,), generator=g))
        spans.append((start, int(torch.randint(1, 20, (1,), generator=g))))
        prompt_lens.append(prompt)
    anchor = int(torch.randint(1, 5, (1,), generator=g))
    positions, qsl = _batch(spans)
    sel = select_upper_rows(positions, qsl, torch.tensor(prompt_lens), anchor)
    expected, offsets = [], [0]
    for r, (start, n) in enumerate(spans):
        for i in range(n):
            if is_upper_active(start + i, prompt_lens[r], anchor):
                expected.append(int(qsl[r]) + i)
        offsets.append(len(expected))
    assert sel.rows.tolist() == expected
    assert sel.query_start_loc.tolist() == offsets
