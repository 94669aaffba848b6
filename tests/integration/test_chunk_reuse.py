"""ChunkReuseConnector inside real vLLM CPU engines (SmolLM2, float32).

Four documents (essay slices, one carrying a passcode) are presented in three orders; the first
prompt saves the chunks, the later ones reuse them at new offsets. Checks: with every claimed
token recomputed (``cacheblend`` at ratio 1.0) and APE attention at a temperature of ~1 the
output is token-identical to no reuse, so loading, re-rotation, the recompute path and APE's
attention over the pages are exact; so is ``query`` at ratio 1.0 (its probe of the pages by the
question writes nothing); EPIC answers correctly while recomputing a small fraction; an
unreachable store and a different cache salt give exactly the no-reuse behaviour, and a second
engine reuses, through Redis, the chunks the first saved for the same tenant; chunked prefill
with prefix caching still answers.
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

import pytest

from vllm_accel.bench.harness import engine_settings, run_side
from vllm_accel.bench.redis_server import available as redis_server_available
from vllm_accel.bench.redis_server import redis_server

ORDERS = ([0, 1, 2, 3], [2, 0, 3, 1], [3, 2, 1, 0])
MAX_TOKENS = 10
PASSCODE = "7391"


@pytest.fixture(scope="module")
def prompts(default_model) -> list[list[int]]:
    from transformers import AutoTokenizer

    from vllm_accel.quality.data import essays_dir

    tok = AutoTokenizer.from_pretrained(default_model)
    sep = tok.convert_tokens_to_ids("<file_sep>")
    names = sorted(p for p in Path(essays_dir()).glob("*.txt"))[:4]
    docs = [tok.encode(p.read_text(), add_special_tokens=False)[:260] for p in names]
    fact = tok.encode(f" The secret passcode is {PASSCODE}. ", add_special_tokens=False)
    docs[1] = docs[1][:120] + fact + docs[1][120:]
    head = tok.encode("You answer questions about documents.", add_special_tokens=False)
    question = tok.encode("Question: what is the secret passcode? Answer: The secret passcode is",
                          add_special_tokens=False)
    return [head + [t for i in order for t in [sep] + docs[i]] + [sep] + question
            for order in ORDERS]


def _reuse(**extra) -> dict:
    return {"kv_transfer_config": {
        "kv_connector": "ChunkReuseConnector",
        "kv_connector_module_path": "vllm_accel.kv_connector", "kv_role": "kv_both",
        # counters logged after every step / finished request: the tests read the last line,
        # and a short run may end before the 10 s interval with a shutdown that is cut short
        "kv_connector_extra_config": {"min_reuse_tokens": 16, "log_interval_s": 0, **extra}}}


@pytest.fixture
def run(tmp_path, default_model):
    def go(label: str, prompts, **engine):
        settings = engine_settings(default_model, 2048, 0.2, {"dtype": "float32", **engine})
        task = {"kind": "generate", "name": "out", "prompts": prompts, "max_tokens": MAX_TOKENS,
                "sequential": True, "ignore_eos": True}
        result = run_side(label, settings, [task], timeout_s=900, log_dir=tmp_path)
        return ([o["token_ids"] for o in result["tasks"]["out"]], [o["text"] for o in
                result["tasks"]["out"]], Path(tmp_path, f"{label}.log").read_text())
    return go


def _counter(log: str, side: str, name: str) -> float:
    """The last logged value of a connector counter (0 when never logged)."""
    values = re.findall(rf"chunk reuse \({side}\): [^;]*\b{name}=([0-9.e+-]+)", log)
    return float(values[-1]) if values else 0.0


@pytest.fixture(scope="module")
def plain(prompts, tmp_path_factory, default_model):
    """(token ids, texts) without the connector."""
    settings = engine_settings(default_model, 2048, 0.2, {"dtype": "float32"})
    task = {"kind": "generate", "name": "out", "prompts": prompts, "max_tokens": MAX_TOKENS,
            "sequential": True, "ignore_eos": True}
    result = run_side("plain", settings, [task], timeout_s=900,
                      log_dir=tmp_path_factory.mktemp("plain"))
    outs = result["tasks"]["out"]
    return [o["token_ids"] for o in outs], [o["text"] for o in outs]


@pytest.mark.real_model
def test_full_recompute_through_the_connector_is_exact(run, prompts, plain):
    # APE at a temperature of ~1 also runs: its attention over the pages (batch rows -> requests,
    # positions, chunk mask) must reproduce vLLM's own for the question and generated tokens
    tokens, _, log = run("cacheblend-all", prompts,
                         **_reuse(recompute="cacheblend", recompute_ratio=1.0,
                                  attention_temperature=0.99999))
    assert _counter(log, "scheduler", "reused_requests") == 2  # orders 2 and 3 reused chunks
    assert _counter(log, "worker", "load_failures") == 0
    assert "APE attention on 30 layers" in log
    # the question and 9 generated tokens of 2 prompts, in each of 30 layers
    assert _counter(log, "worker", "ape_token_layers") >= 2 * 10 * 30
    assert tokens == plain[0]


@pytest.mark.real_model
def test_query_probe_then_full_recompute_is_exact(run, prompts, plain):
    """``recompute=query`` at ratio 1.0: the question probes the loaded pages (writing nothing),
    then every reused token is recomputed, so the output is the no-reuse output."""
    tokens, _, log = run("query-all", prompts, **_reuse(recompute="query", recompute_ratio=1.0))
    assert _counter(log, "scheduler", "reused_requests") == 2
    # every claimed token-layer but the system prompt's (exact), plus the probe's suffix rows
    assert _counter(log, "worker", "recompute_fraction") > 0.95
    assert tokens == plain[0]


@pytest.mark.real_model
def test_epic_reuses_chunks_and_answers(run, prompts, plain):
    _, texts, log = run("epic", prompts, **_reuse(recompute="epic"))
    assert _counter(log, "scheduler", "reused_requests") == 2
    assert _counter(log, "scheduler", "hit_tokens") > 1000
    assert 0 < _counter(log, "worker", "recompute_fraction") < 0.15
    # the 135M model misses the passcode in the last order even without reuse; reuse must
    # answer wherever full computation does (the first order is computed, not reused)
    answered = [PASSCODE in t for t in plain[1]]
    assert answered[:2] == [True, True]
    reused = [PASSCODE in t for t in texts]
    assert all(r or not a for r, a in zip(reused, answered)), texts


@pytest.mark.real_model
def test_unreachable_store_and_other_salt_give_no_reuse(run, prompts, plain):
    tokens, _, log = run("redis-down", prompts, **_reuse(stores=["redis://127.0.0.1:9/0"]))
    assert tokens == plain[0]
    assert _counter(log, "scheduler", "reused_requests") == 0
    with contextlib.ExitStack() as stack:
        stores = ["memory"]
        if redis_server_available():  # two instances share it (below)
            stores = [stack.enter_context(redis_server()).url]
        salted = [{"prompt_token_ids": p, "cache_salt": f"tenant-{i}"}
                  for i, p in enumerate(prompts)]
        tokens, _, log = run("salted", salted, **_reuse(stores=stores))
        assert _counter(log, "scheduler", "reused_requests") == 0  # no cross-tenant hit
        assert _counter(log, "worker", "saved_chunks") >= 12  # each tenant saved its own chunks
        assert tokens == plain[0]
        if stores == ["memory"]:
            pytest.skip("redis-server not installed: the two-instance check did not run")
        # A second engine (another process, never saw tenant-0's prompt) reuses what the first
        # saved to Redis, for tenant 0 only; exact recompute gives the no-reuse tokens.
        again = [{"prompt_token_ids": p, "cache_salt": "tenant-0"} for p in prompts[1:]]
        tokens, _, log = run("second-instance", again,
                             **_reuse(stores=stores, recompute="cacheblend", recompute_ratio=1.0))
        assert _counter(log, "scheduler", "reused_requests") == 2
        assert _counter(log, "scheduler", "hit_tokens") > 1000
        assert tokens == plain[0][1:]


@pytest.mark.real_model
def test_chunked_prefill_with_prefix_caching(run, prompts):
    _, texts, log = run("chunked", prompts[:2] + prompts[1:2], enable_prefix_caching=True,
                        max_num_batched_tokens=256, enable_chunked_prefill=True,
                        **_reuse(recompute="epic"))
    assert _counter(log, "scheduler", "reused_requests") >= 1
    assert all(PASSCODE in t for t in texts), texts


@pytest.mark.real_model
def test_serve_reuses_documents_marked_in_prompt_text(default_model, tmp_path):
    """OpenAI completions with documents separated by the special token in plain text; the
    counters appear in vLLM's Prometheus /metrics; malformed kv_transfer_params get a 400
    naming the parameter before they reach the engine, and the server keeps serving."""
    import json
    import urllib.error

    from vllm_accel.bench.server import metric_total, post_json, read_metrics, served
    from vllm_accel.quality.data import essays_dir

    config = _reuse()["kv_transfer_config"]
    docs = [p.read_text()[:900] for p in sorted(Path(essays_dir()).glob("*.txt"))[:3]]
    args = ["--dtype", "float32", "--served-model-name", "m", "--kv-transfer-config",
            json.dumps(config)]
    with served(default_model, args, tmp_path / "serve.log") as server:
        url = server.url
        def ask(order: list[int]) -> str:
            prompt = ("Documents:" + "".join("<file_sep>" + docs[i] for i in order)
                      + "<file_sep>Question: which document is about Apple?")
            out = post_json(f"{url}/v1/completions", {"model": "m", "prompt": prompt,
                                                  "max_tokens": 4, "temperature": 0})
            return out["choices"][0]

        texts = [ask(order)["text"] for order in ([0, 1, 2], [2, 0, 1])]
        with pytest.raises(urllib.error.HTTPError) as refused:
            post_json(f"{url}/v1/completions", {"model": "m", "prompt": "a<file_sep>b<file_sep>c",
                                            "max_tokens": 2,
                                            "kv_transfer_params": {"chunk_spans": [[3, 1]]}})
        assert refused.value.code == 400
        error = json.loads(refused.value.read())["error"]
        assert error["param"] == "kv_transfer_params", error
        assert "chunk_spans: [3, 1] must be non-empty" in error["message"], error
        assert ask([1, 2, 0])["finish_reason"] in ("length", "stop")  # still serving
        time.sleep(1)
        samples = read_metrics(url)

    def metric(name: str) -> float:
        full = f"vllm:chunk_reuse_{name}_total"
        assert any(key.startswith(full + "{") for key in samples), f"{full} missing from /metrics"
        return metric_total(samples, full)

    assert metric("reused_requests") == 2
    assert metric("hit_tokens") >= 128
    assert metric("saved_chunks") >= 3
    assert metric("markup_errors") == 0  # refused in the front end
    assert all(texts)

