"""The load generator against a small fake OpenAI server (no vLLM): streaming, client
cancellations, expected and unexpected statuses, percentiles."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_accel.bench.openai_load import LoadRequest, percentiles, run_load, summarize
from vllm_accel.bench.server import engine_flags


class FakeOpenAI(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up
            pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        if prompt == "bad":
            return self._send(400, {"error": {"message": "bad prompt", "param": "prompt"}})
        if prompt == "slow":
            time.sleep(1.0)
        if not body.get("stream"):
            return self._send(200, {"choices": [{"text": "hello", "finish_reason": "length"}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        if prompt == "bad-late":  # vLLM: an error found after the headers went out
            error = {"error": {"message": "bad params", "param": "kv_transfer_params",
                               "code": 400}}
            self.wfile.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            self.close_connection = True
            return
        try:
            for i in range(5):
                last = "length" if i == 4 else None
                chunk = {"choices": [{"text": "ab"[i % 2], "finish_reason": last}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.02)
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):  # the client cancelled
            pass
        self.close_connection = True


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def req(prompt: str, **kw) -> LoadRequest:
    return LoadRequest("completions", {"prompt": prompt}, **kw)


def test_results_cover_streaming_cancellation_and_statuses(url):
    requests = [req("x"), req("x", stream=True), req("x", stream=True, cancel_after_chunks=2),
                req("slow", cancel_after_s=0.2), req("bad", expect_status=400, tag="bad"),
                req("bad"), req("x", stream=True)]
    done = []
    results = run_load(url, requests, concurrency=3, on_progress=done.append)
    assert done == list(range(1, len(requests) + 1))
    plain, streamed, cut, abandoned, refused, failed, _ = results
    assert (plain.ok, plain.text, plain.finish_reason, plain.ttft_s) == (True, "hello", "length",
                                                                          None)
    assert streamed.ok and streamed.text == "ababa" and streamed.chunks == 5
    assert 0 < streamed.ttft_s <= streamed.latency_s
    assert cut.cancelled and cut.chunks == 2 and cut.text == "ab" and cut.ok
    assert abandoned.cancelled and abandoned.ok and abandoned.status is None
    assert refused.ok and refused.status == 400 and refused.body["param"] == "prompt"
    assert not failed.ok and "HTTP 400, expected 200" in failed.error
    late = run_load(url, [req("bad-late", stream=True, expect_status=400)], concurrency=1)[0]
    assert late.ok and late.status == 400 and late.error_in_stream
    assert late.body["param"] == "kv_transfer_params"
    report = summarize(results, wall_s=2.0)
    assert (report["requests"], report["errors"], report["cancelled"]) == (7, 1, 2)
    assert report["finished"] == 3  # 200s run to their end (the refused one is not timed)
    assert report["by_tag"]["bad"] == {"requests": 1, "errors": 0, "cancelled": 0}


def test_a_dead_server_is_an_error_per_request_not_a_crash():
    results = run_load("http://127.0.0.1:9", [req("x"), req("x", stream=True)], concurrency=2)
    assert all(not r.ok and "Connect" in r.error for r in results)


def test_percentiles_nearest_rank():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    values = list(range(1, 101))
    assert percentiles(values) == {"p50": 50, "p90": 90, "p99": 99}
    assert percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}


def test_engine_flags_turn_settings_into_vllm_serve_flags():
    assert engine_flags({"attention_backend": "X", "enable_prefix_caching": False,
                         "enforce_eager": True, "max_num_seqs": 8, "seed": None,
                         "kv_transfer_config": {"a": 1}}) == [
        "--attention-backend", "X", "--no-enable-prefix-caching", "--enforce-eager",
        "--max-num-seqs", "8", "--kv-transfer-config", '{"a": 1}']
