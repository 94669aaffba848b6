"""The cpu_rejection_expand runtime patch: per-draft-token sampling parameters on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_accel._patches.cpu_rejection_expand import _make_replacement, expand_on_cpu

CU = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # 2, 0, 3 and 1 draft tokens


@pytest.mark.parametrize("x, expected", [
    (torch.tensor([0.7, 0.1, 1.0, 0.5]), [0.7, 0.7, 1.0, 1.0, 1.0, 0.5]),  # temperature
    (torch.tensor([4, 9, 2, 7], dtype=torch.int32), [4, 4, 2, 2, 2, 7]),  # top-k
])
def test_expands_each_request_value_over_its_draft_tokens_keeping_the_dtype(x, expected):
    out = expand_on_cpu(x, CU, 6)
    assert out.dtype == x.dtype and out.tolist() == pytest.approx(expected)


def test_replaces_the_greedy_marker():
    temperature = torch.tensor([0.0, 0.5, 0.0, 2.0])
    # request 1 has no draft tokens: its 0.5 appears nowhere
    assert expand_on_cpu(temperature, CU, 6, replace_from=0, replace_to=1).tolist() == [
        1.0, 1.0, 1.0, 1.0, 1.0, 2.0]
    assert expand_on_cpu(torch.tensor([], dtype=torch.int32),
                         torch.tensor([], dtype=torch.int32), 0).numel() == 0


def test_other_devices_go_to_vllms_kernel():
    calls = []
    wrapped = _make_replacement(lambda *args: calls.append(args) or "triton")
    fake_cuda = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    assert wrapped(fake_cuda, CU, 6, 0, 1) == "triton" and calls == [(fake_cuda, CU, 6, 0, 1)]
    assert wrapped(torch.tensor([3.0]), torch.tensor([2]), 2).tolist() == [3.0, 3.0]
