"""Make speculative decoding keep the sampling distribution on vLLM's CPU build.

To verify drafts under random sampling, vLLM's rejection sampler expands each request's
temperature, top-k and top-p to one value per draft token
(``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens``). Without Triton (the CPU build)
the expansion runs ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which converts the
output tensor to int64 before calling the C++ kernel: for float32 temperatures / top-p and
int32 top-k that conversion is a copy, the kernel fills the copy, and the real output keeps
whatever memory ``new_empty`` returned. Draft positions are then sampled with garbage
temperature / top-k / top-p: the output distribution changes (or the engine dies on an
out-of-range top-k), for every speculative method, ours and vLLM's ``ngram`` alike. Greedy
requests are unaffected.

The patch replaces ``expand_batch_to_tokens`` with the same expansion in plain torch for CPU
tensors (``repeat_interleave``; same ``replace_from`` -> ``replace_to`` substitution); tensors
on other devices go to the original (the Triton kernel is correct). Upstream twin:
``patches/0009-cpu-expand-kernel-non-int64.patch`` (fixes the CPU kernel wrapper itself).
"""

from __future__ import annotations

from typing import Any

from vllm_accel.patching import RuntimePatch


def expand_on_cpu(x: Any, cu_num_tokens: Any, num_tokens: int, replace_from: Any = 0,
                  replace_to: Any = 0) -> Any:
    """``[a, b, c]`` with ``cu_num_tokens = [2, 5, 6]`` -> ``[a, a, b, b, b, c]``, and every
    element equal to ``replace_from`` replaced by ``replace_to``."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    if replace_from != replace_to:
        out = out.masked_fill(out == replace_from, replace_to)
    return out


def _make_replacement(original: Any) -> Any:
    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        if x.device.type != "cpu":
            return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        return expand_on_cpu(x, cu_num_tokens, num_tokens, replace_from, replace_to)

    return expand_batch_to_tokens


PATCH = RuntimePatch(
    name="cpu_rejection_expand",
    target="vllm.v1.sample.rejection_sampler:expand_batch_to_tokens",
    vllm_versions=("0.32.0",),
    upstream_diff="0009-cpu-expand-kernel-non-int64.patch",
    reason="on CPU, draft verification samples with uninitialised temperature/top-k/top-p",
    make_replacement=_make_replacement,
)
