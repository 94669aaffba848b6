"""ACCEL_SPEED's upper-layer token selection and attention metadata (no engine)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from vllm_accel.speed.backend import select_upper_tokens  # noqa: E402


def _cm(query_lens, seq_lens, block_size=4):
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    pages = max(-(-s // block_size) for s in seq_lens)
    table = torch.arange(len(seq_lens) * pages, dtype=torch.int32).view(len(seq_lens), pages)
    slots = torch.cat([table[r, torch.arange(s - q, s) // block_size].long() * block_size
                       + torch.arange(s - q, s) % block_size
                       for r, (q, s) in enumerate(zip(query_lens, seq_lens))])
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=len(seq_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=table, slot_mapping=slots)


def test_mixed_batch_selects_anchors_last_prompt_token_and_decodes():
    # r0: decode (prompt 10, 3 generated -> position 12); r1: whole 9-token prompt;
    # r2: a middle chunk (positions 8..15 of a 30-token prompt): nothing upper-active;
    # r3: the final chunk (positions 24..29 of a 30-token prompt): only position 29
    cm = _cm([1, 9, 8, 6], [13, 9, 16, 30])
    meta = select_upper_tokens(cm, torch.tensor([10, 9, 30, 30]), anchor_tokens=2)
    # rows: r0's token (row 0); r1's positions 0, 1 (anchors) and 8 (rows 1, 2, 9); r3's 29
    assert meta.rows.tolist() == [0, 1, 2, 9, 23]
    assert meta.query_positions.tolist() == [12, 0, 1, 8, 29]
    assert meta.query_start_loc == [0, 1, 4, 4, 5]
    assert meta.num_actual_tokens == 5
    assert meta.slot_mapping.tolist() == cm.slot_mapping[[0, 1, 2, 9, 23]].tolist()
    assert meta.seq_lens == [13, 9, 16, 30] and meta.prompt_lens == [10, 9, 30, 30]


def test_dummy_rows_without_prompt_length_run_everything():
    """Rows with prompt length 0 (vLLM's dummy/profiling batches) are all upper-active."""
    cm = _cm([5], [5])
    meta = select_upper_tokens(cm, torch.tensor([0]), anchor_tokens=1)
    assert meta.rows.tolist() == [0, 1, 2, 3, 4]
