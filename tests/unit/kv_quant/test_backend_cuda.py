"""``--kv-cache-dtype kivi_*`` on vLLM's CUDA platform: what start-up accepts and refuses there,
and the Builder and Impl running a mixed decode + chunked-prefill step on the Triton kernels
(on the CPU under ``TRITON_INTERPRET=1``: no GPU here; the engine path on CUDA has not run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import vllm_accel.kernels.kivi_cache as kivi_cache  # noqa: E402
from vllm_accel.attention import step_requests  # noqa: E402
from vllm_accel.kernels.kivi_format import fake_quant_kv, reference_attention  # noqa: E402
from vllm_accel.kv_quant import backend as kivi_backend  # noqa: E402
from vllm_accel.kv_quant.backend import (  # noqa: E402
    Kivi4BitBackend,
    page_layout,
    platform_problems,
    startup_problems,
)
from vllm_accel.kv_quant.config import KvQuantKnobs  # noqa: E402

from ..kernels.conftest import requires_triton_interpreter  # noqa: E402
from .test_dtype_registration import _selector_config  # noqa: E402

H_Q, H_KV, D, N = 4, 2, 64, 128
FLAG = "--kv-cache-dtype kivi_4bit"
CUDA = SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True)


def _use_config(monkeypatch, **fields):
    """Make ``fields`` the current vLLM config (what vLLM sets while it builds the model)."""
    import vllm.config

    config = SimpleNamespace(**{"additional_config": None, **fields})
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: config)
    return config


def _kernel_knob(kernel):
    return {"vllm_accel": {"kv_quant": {"kernel": kernel}}}


def test_cuda_is_accepted_with_the_triton_kernels(monkeypatch):
    _use_config(monkeypatch)
    monkeypatch.setattr(kivi_cache, "HAS_TRITON", True)
    assert platform_problems(FLAG, CUDA) == []
    _use_config(monkeypatch, additional_config=_kernel_knob("torch"))
    assert platform_problems(FLAG, CUDA) == []


def test_cuda_refuses_the_native_knob_and_a_missing_triton(monkeypatch):
    _use_config(monkeypatch, additional_config=_kernel_knob("native"))
    (native,) = platform_problems(FLAG, CUDA)
    assert "kernel='native'" in native and "auto, triton, torch" in native
    _use_config(monkeypatch)
    monkeypatch.setattr(kivi_cache, "HAS_TRITON", False)
    (triton,) = platform_problems(FLAG, CUDA)
    assert "needs Triton" in triton and "torch" in triton


def test_other_platforms_are_refused_naming_the_flag():
    rocm = SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: False)
    (problem,) = platform_problems(FLAG, rocm)
    assert FLAG in problem and "CPU and CUDA" in problem


def test_cudas_default_block_size_is_left_for_vllm_to_align(monkeypatch):
    """CUDA's default block (16, not user-set) is no error: vLLM aligns it to the backend's
    kernel block sizes (64); a user's --block-size 16 is refused."""
    cache = SimpleNamespace(block_size=16, user_specified_block_size=False)
    _use_config(monkeypatch, cache_config=cache)
    assert startup_problems("kivi_4bit", _selector_config(block_size=None)) == []
    assert Kivi4BitBackend.get_preferred_block_size(16) == 64
    cache.user_specified_block_size = True
    (block,) = startup_problems("kivi_4bit", _selector_config(block_size=None))
    assert "--block-size 16" in block


def test_vllms_cuda_selection_accepts_the_backend():
    """What ``CudaPlatform.get_attn_backend_cls`` runs for an explicitly selected backend."""
    reasons = Kivi4BitBackend.validate_configuration(
        device_capability=DeviceCapability(9, 0), **_selector_config(block_size=None)._asdict())
    assert reasons == []
    assert Kivi4BitBackend.get_builder_cls().get_cudagraph_support(None, None) == \
        AttentionCGSupport.NEVER


@requires_triton_interpreter
@pytest.mark.parametrize("residual", ["tail", "page"])
def test_builder_and_impl_run_a_mixed_step_on_the_triton_kernels(monkeypatch, residual):
    """Step 1 prefills a (70 tokens) and b (40); step 2 batches a's decode token with b's next
    30-token chunk. Every output row of step 2 matches the format's reference attention."""
    torch.manual_seed(0)
    knobs = {"vllm_accel": {"kv_quant": {"kernel": "triton", "residual": residual}}}
    config = _use_config(
        monkeypatch, additional_config=knobs,
        model_config=SimpleNamespace(dtype=torch.bfloat16),
        device_config=SimpleNamespace(device="cpu"),
        scheduler_config=SimpleNamespace(max_num_seqs=4), speculative_config=None,
        cache_config=SimpleNamespace(cache_dtype="kivi_4bit"),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    from vllm_accel._patches import attention_step_requests

    # the patch publishes the runner's rows; here the test publishes them itself
    monkeypatch.setattr(attention_step_requests, "enable", lambda: None)
    monkeypatch.setattr(kivi_backend, "_ENGINE_STATE", {})  # this engine's pools only
    spec = FullAttentionSpec(block_size=N, num_kv_heads=H_KV, head_size=D, dtype=torch.uint8)
    builder = Kivi4BitBackend.get_builder_cls()(spec, ["L0"], config, torch.device("cpu"))
    impl = Kivi4BitBackend.get_impl_cls()(H_Q, D, D**-0.5, H_KV, None, None, "kivi_4bit")
    assert impl.kernel == "triton"

    layout = page_layout("kivi_4bit", D, N, knobs=KvQuantKnobs(residual=residual))
    cache = layout.allocate(num_blocks=4, num_kv_heads=H_KV)
    tables = {"a": [2, 0], "b": [3, 1]}
    seqs = {r: [torch.randn(100, h, D, dtype=torch.bfloat16) for h in (H_Q, H_KV, H_KV)]
            for r in tables}
    layer = SimpleNamespace(layer_name="L0")
    metadata = {}
    import vllm.model_executor.layers.attention.attention as vllm_attention

    monkeypatch.setattr(vllm_attention, "get_attention_context",
                        lambda name: (metadata[name], None, None, None))

    def step(rows):  # rows: (request, first position, last position + 1)
        qsl = torch.tensor([0, *torch.tensor([hi - lo for _, lo, hi in rows]).cumsum(0)],
                           dtype=torch.int32)
        table = torch.tensor([tables[r] for r, _, _ in rows], dtype=torch.int32)
        slots = torch.tensor([tables[r][p // N] * N + p % N
                              for r, lo, hi in rows for p in range(lo, hi)])
        cm = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl,
            seq_lens=torch.tensor([hi for _, _, hi in rows], dtype=torch.int32),
            num_reqs=len(rows), num_actual_tokens=int(qsl[-1]),
            max_query_len=max(hi - lo for _, lo, hi in rows),
            max_seq_len=max(hi for _, _, hi in rows), block_table_tensor=table,
            slot_mapping=slots)
        step_requests.publish(step_requests.StepRequests(
            prompt_lens=torch.tensor([100] * len(rows)), req_ids=[r for r, _, _ in rows],
            live_req_ids=set(tables)))
        try:
            metadata["L0"] = builder.build(0, cm)
        finally:
            step_requests.publish(None)
        q, k, v = (torch.cat([seqs[r][j][lo:hi] for r, lo, hi in rows]) for j in range(3))
        out = torch.full_like(q, float("nan"))
        impl.do_kv_cache_update(layer, k, v, cache, slots)
        impl.forward(layer, q, k, v, cache, metadata["L0"], out)
        return out

    step([("a", 0, 70), ("b", 0, 40)])
    out = step([("a", 70, 71), ("b", 40, 70)])
    for (r, lo, hi), rows in ((("a", 70, 71), out[:1]), (("b", 40, 70), out[1:])):
        q, k, v = (t[:hi] for t in seqs[r])
        kq, vq = fake_quant_kv(k, v, layout)
        torch.testing.assert_close(rows.float(), reference_attention(q[lo:hi], kq, vq),
                                   atol=2e-2, rtol=2e-2)
    if residual == "tail":  # each request's unfinished group came from its own pool entry
        assert builder.tail_pool is not None and len(builder.tail_pool.slots) == 2
