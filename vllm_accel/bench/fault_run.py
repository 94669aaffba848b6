"""``vllm-accel fault-run``: the OpenAI server with chunk reuse and a proposer keeps serving,
and answers right, while its stores and proposer break.

The served engine: ``ChunkReuseConnector`` over a Redis server this command starts (the
fastest tier) and a disk store, ``SAMProposer`` (4 draft tokens), float32, prefix caching off
so that every repeated document goes through the connector. Faults, at fixed points of the
request stream:

* the proposer raises on about ``proposer_fault_rate`` of its drafting calls, the whole run
  (``VLLM_ACCEL_INJECT_FAULTS``; the step gets no drafts);
* Redis is killed (SIGKILL) at 20 % of the requests and restarted, empty, at 40 %;
* at 55 % every disk file is corrupted (bytes flipped, or truncated) and Redis is flushed, so
  the next loads read corrupt files;
* one request in 12 carries malformed ``kv_transfer_params`` and one in 20 is longer than the
  context: each must be refused with a 400 (an HTTP 400, or, for a streamed request that vLLM
  validates after sending the headers, an error event with code 400 in the stream).

The other requests put one essay document at one offset (``system SEP document SEP question``)
or are short prompts, all greedy: reusing a document's KV is then exact, so each answer must
equal, token for token, plain vLLM's answer to the same request (served first, same load);
wrong KV from a corrupt file or another chunk would change it. The report counts wrong
answers, unexpected statuses, and the faults as ``/metrics`` shows them.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_accel.bench.chunk_reuse import CONNECTOR
from vllm_accel.bench.openai_load import LoadRequest, run_load, summarize
from vllm_accel.bench.redis_server import redis_server
from vllm_accel.bench.server import engine_flags, metric_total, read_metrics, served
from vllm_accel.bench.soak_workload import essay_pool, separator_text
from vllm_accel.bench.spec_decode import SAM_CLASS
from vllm_accel.log import get_logger

logger = get_logger("fault_run")

SERVED_NAME = "m"
COMMON = {"dtype": "float32", "served_model_name": SERVED_NAME,
          "enable_prefix_caching": False, "max_num_seqs": 8}
MAX_MODEL_LEN = 2048
#: Fault metrics read at the end: (name, labels).
FAULT_METRICS = {
    "store_errors": ("vllm:chunk_reuse_store_errors_total", {}),
    "store_corrupt": ("vllm:chunk_reuse_store_corrupt_total", {}),
    "load_failures": ("vllm:chunk_reuse_load_failures_total", {}),
    "proposer_errors": ("vllm:accel_proposer_errors_total", {}),
    "rejected_kv_transfer_params": ("vllm:kv_transfer_params_rejected_total", {}),
    "http_4xx": ("http_requests_total", {"status": "4xx"}),
    "reused_requests": ("vllm:chunk_reuse_reused_requests_total", {}),
    "saved_chunks": ("vllm:chunk_reuse_saved_chunks_total", {}),
}


def corrupt_files(root: Path, rng: random.Random) -> int:
    """Flip bytes in the middle of every stored chunk file (every third one: truncate it)."""
    files = sorted(root.rglob("*.chunk"))
    for i, path in enumerate(files):
        blob = bytearray(path.read_bytes())
        if i % 3 == 2:
            blob = blob[: len(blob) // 2]
        else:
            for _ in range(16):
                j = rng.randrange(len(blob) // 4, len(blob))
                blob[j] ^= 0xFF
        path.write_bytes(bytes(blob))
    return len(files)


def fault_requests(count: int, separator: str, essays: dict[str, str], seed: int = 0
                   ) -> list[LoadRequest]:
    """The request stream (see the module docstring); ``tag`` says what each must get."""
    rng = random.Random(f"fault-run-{seed}")
    documents = essay_pool(essays, 6, rng)
    long_text = " ".join(essays.values())[: 4 * 2 * MAX_MODEL_LEN]
    requests = []
    for i in range(count):
        stream = rng.random() < 0.5
        body: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": 16, "temperature": 0.0}
        if i % 12 == 5:
            body["prompt"] = f"a{separator}b{separator}c"
            body["kv_transfer_params"] = {"chunk_spans": [[rng.randint(3, 9), 1]]}
            requests.append(LoadRequest("completions", body, stream, expect_status=400,
                                        tag="malformed"))
        elif i % 20 == 13:
            body["prompt"] = long_text
            requests.append(LoadRequest("completions", body, stream, expect_status=400,
                                        tag="oversize"))
        elif rng.random() < 0.8:
            doc = rng.randrange(len(documents))
            body["prompt"] = (f"You answer questions about the document.{separator}"
                              f"{documents[doc]}{separator}Question: what is the main claim "
                              "of the document? Answer:")
            requests.append(LoadRequest("completions", body, stream, tag="document"))
        else:
            body["prompt"] = rng.choice(("The capital of France is", "def fibonacci(n):",
                                         "List three prime numbers:"))
            requests.append(LoadRequest("completions", body, stream, tag="short"))
    return requests


def _schedule(total: int, actions: dict[float, Callable[[], None]]
              ) -> tuple[Callable[[int], None], list[dict[str, Any]]]:
    """on_progress running each action once when ``fraction * total`` requests are done."""
    pending = sorted((max(1, round(f * total)), f, fn) for f, fn in actions.items())
    log: list[dict[str, Any]] = []

    def on_progress(done: int) -> None:
        while pending and done >= pending[0][0]:
            at, fraction, fn = pending.pop(0)
            fn()
            log.append({"at_request": done, "action": fn.__name__, "fraction": fraction})
            logger.info("fault-run: %s after %d requests", fn.__name__, done)

    return on_progress, log


def run(model: str, requests: int = 120, concurrency: int = 8, seed: int = 0,
        proposer_fault_rate: float = 0.05, log_dir: str | Path = "results/logs"
        ) -> dict[str, Any]:
    from vllm_accel.faults import ENV
    from vllm_accel.quality.data import essays

    stream = fault_requests(requests, separator_text(model), essays(), seed)
    checked = [i for i, r in enumerate(stream) if r.expect_status == 200]
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)

    with served(model, engine_flags(COMMON), log_dir / "fault-run-reference.log",
                MAX_MODEL_LEN) as server:
        reference = run_load(server.url, [stream[i] for i in checked], concurrency)
    if any(not r.ok for r in reference):
        raise RuntimeError(f"plain vLLM failed a reference request: "
                           f"{next(r.error for r in reference if not r.ok)}")
    expected = {i: r.text for i, r in zip(checked, reference)}

    with tempfile.TemporaryDirectory(prefix="vllm-accel-fault-run-") as work:
        work_dir = Path(work)
        store_dir = work_dir / "chunks"
        rng = random.Random(seed)
        with redis_server() as redis:
            def kill_redis() -> None:
                redis.kill()

            def restart_redis() -> None:
                redis.start()

            def corrupt_store() -> None:
                redis.flush()
                corrupt_files(store_dir, rng)

            engine = {**COMMON, "kv_transfer_config": {
                **CONNECTOR,
                # EPIC: the policy of the run docs/serving.md reports (the default was then)
                "kv_connector_extra_config": {"stores": [redis.url, f"disk:{store_dir}"],
                                              "recompute": "epic"}},
                "speculative_config": {"method": "custom_class", "model": SAM_CLASS,
                                       "num_speculative_tokens": 4}}
            on_progress, actions = _schedule(requests, {0.2: kill_redis, 0.4: restart_redis,
                                                        0.55: corrupt_store})
            with served(model, engine_flags(engine), log_dir / "fault-run.log", MAX_MODEL_LEN,
                        env={ENV: f"proposer={proposer_fault_rate}"}) as server:
                started = time.perf_counter()
                results = run_load(server.url, stream, concurrency, on_progress=on_progress)
                wall_s = time.perf_counter() - started
                time.sleep(1.0)  # the last step's connector stats reach /metrics
                samples = read_metrics(server.url)

    wrong = [{"index": i, "tag": stream[i].tag, "expected": expected[i], "got": r.text}
             for i, r in enumerate(results) if i in expected and r.ok and r.text != expected[i]]
    report = summarize(results, wall_s)
    report.update(
        model=model, seed=seed, proposer_fault_rate=proposer_fault_rate, actions=actions,
        wrong_answers=len(wrong), first_wrong=wrong[:5], checked_answers=len(expected),
        metrics={k: metric_total(samples, name, **labels)
                 for k, (name, labels) in FAULT_METRICS.items()},
        expected_400=sum(r.expect_status == 400 for r in stream),
        http_400=sum(r.status == 400 and not r.error_in_stream for r in results),
        stream_400=sum(r.status == 400 and r.error_in_stream for r in results),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    return report


def failures(report: dict[str, Any]) -> list[str]:
    """What the run shows went wrong (empty: every check held)."""
    m = report["metrics"]
    checks = {
        "requests failed or got an unexpected status": report["errors"] == 0,
        "answers differ from plain vLLM": report["wrong_answers"] == 0,
        "Redis outage not counted (store_errors)": m["store_errors"] > 0,
        "corrupt files not counted (store_corrupt)": m["store_corrupt"] > 0,
        "proposer faults not counted (proposer_errors)": (m["proposer_errors"] > 0
                                                          or not report["proposer_fault_rate"]),
        "malformed params not counted (kv_transfer_params_rejected)": (
            m["rejected_kv_transfer_params"]
            == report["by_tag"].get("malformed", {}).get("requests", 0)),
        "400 answers not counted (http_requests_total)": m["http_4xx"] >= report["http_400"],
    }
    return [name for name, ok in checks.items() if not ok]


def main(model: str, json_path: str | None, **kwargs: Any) -> int:
    report = run(model, **kwargs)
    failed = failures(report)
    print(json.dumps({k: report[k] for k in ("requests", "errors", "wrong_answers",
                                             "checked_answers", "expected_400", "http_400",
                                             "stream_400", "metrics",
                                             "actions", "latency_s")}, indent=1))
    print("fault run: " + ("PASSED" if not failed else "FAILED: " + "; ".join(failed)))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1))
    return 1 if failed else 0
