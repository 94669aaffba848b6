"""A bounded, closed-loop load generator for an OpenAI-compatible server (loopback).

``concurrency`` clients take :class:`LoadRequest` s from one queue in order, each sending its
next request as soon as the last one ended, so at most ``concurrency`` requests are in flight.
A request is a completion or a chat completion, streamed or not; it may be cancelled by the
client (a stream closed after ``cancel_after_chunks`` chunks, a plain request abandoned after
``cancel_after_s``), which makes vLLM abort it. Every request gets a :class:`RequestResult`:
HTTP status, time to the first streamed token, end-to-end latency, output text.
``on_progress(done)`` is called on the event loop after each request ends (the fault run uses
it to break things at chosen points); it must be quick.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class LoadRequest:
    endpoint: str  # "completions" | "chat/completions"
    body: dict[str, Any]  # without "stream"
    stream: bool = False
    cancel_after_chunks: int | None = None  # streamed: close the stream after this many chunks
    cancel_after_s: float | None = None  # not streamed: abandon the request after this long
    expect_status: int = 200
    tag: str = ""  # what kind of request this is (reported per tag)

    @property
    def cancels(self) -> bool:
        return self.cancel_after_chunks is not None or self.cancel_after_s is not None


@dataclass
class RequestResult:
    index: int
    tag: str
    stream: bool
    status: int | None = None  # None: cancelled before a response, or no connection
    cancelled: bool = False
    error: str | None = None  # transport error, or an unexpected status's body
    ttft_s: float | None = None  # streamed requests: until the first chunk with text
    latency_s: float | None = None
    text: str = ""
    finish_reason: str | None = None
    chunks: int = 0
    error_in_stream: bool = False  # ``status`` came in an error event of a 200 stream
    started_s: float = 0.0  # since the run started
    body: dict[str, Any] = field(default_factory=dict)  # 4xx answers: the error object

    @property
    def ok(self) -> bool:
        return self.error is None


def _content(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or choice.get("message") or {}).get("content") or ""


def _error_object(payload: Any) -> dict[str, Any]:
    """The ``error`` object of an OpenAI error answer (the whole body if it has none)."""
    return payload.get("error", payload) if isinstance(payload, dict) else {}


async def _send(client: Any, url: str, req: LoadRequest, out: RequestResult) -> None:
    started = time.perf_counter()
    body = {**req.body, "stream": req.stream}
    if not req.stream:
        response = await client.post(url, json=body)
        out.status = response.status_code
        payload = response.json()
        if response.status_code == 200:
            choice = payload["choices"][0]
            out.text, out.finish_reason = _content(choice), choice.get("finish_reason")
        else:
            out.body = _error_object(payload)
        out.latency_s = time.perf_counter() - started
        return
    async with client.stream("POST", url, json=body) as response:
        out.status = response.status_code
        if response.status_code != 200:
            out.body = _error_object(json.loads(await response.aread() or b"{}"))
            out.latency_s = time.perf_counter() - started
            return
        parts = []
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # vLLM reports errors found after the headers in the stream
                out.status, out.body = chunk["error"].get("code") or 500, chunk["error"]
                out.error_in_stream = True
                break
            for choice in chunk.get("choices", []):
                text = _content(choice)
                if text and out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - started
                parts.append(text)
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            out.chunks += 1
            if req.cancel_after_chunks is not None and out.chunks >= req.cancel_after_chunks:
                out.cancelled = True
                break  # leaving the block closes the connection: vLLM aborts the request
        out.text = "".join(parts)
    out.latency_s = time.perf_counter() - started


async def _one(client: Any, base_url: str, index: int, req: LoadRequest, t0: float
               ) -> RequestResult:
    out = RequestResult(index, req.tag, req.stream, started_s=time.perf_counter() - t0)
    url = f"{base_url}/v1/{req.endpoint}"
    try:
        if req.cancel_after_s is not None and not req.stream:
            try:
                await asyncio.wait_for(_send(client, url, req, out), req.cancel_after_s)
            except TimeoutError:  # asyncio.wait_for gave up: a client cancellation
                out.cancelled = True
        else:
            await _send(client, url, req, out)
    except Exception as exc:  # noqa: BLE001 - every failure is a result, not a crash
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    if out.cancelled:
        return out
    if out.status != req.expect_status:
        out.error = f"HTTP {out.status}, expected {req.expect_status}: {out.body}"
    elif out.status == 200 and out.finish_reason is None:
        out.error = "no finish_reason: the response ended early"
    return out


async def _run(base_url: str, requests: Sequence[LoadRequest], concurrency: int,
               on_progress: Callable[[int], None] | None, timeout_s: float
               ) -> list[RequestResult]:
    import httpx

    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(requests)):
        queue.put_nowait(i)
    results: list[RequestResult | None] = [None] * len(requests)
    t0 = time.perf_counter()
    done = 0

    async def client_loop(client: Any) -> None:
        nonlocal done
        while not queue.empty():
            i = queue.get_nowait()
            results[i] = await _one(client, base_url, i, requests[i], t0)
            done += 1
            if on_progress is not None:
                on_progress(done)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return [r for r in results if r is not None]


def run_load(base_url: str, requests: Sequence[LoadRequest], concurrency: int,
             on_progress: Callable[[int], None] | None = None, timeout_s: float = 600
             ) -> list[RequestResult]:
    """Send ``requests`` with ``concurrency`` clients; one result per request, in order."""
    return asyncio.run(_run(base_url, requests, concurrency, on_progress, timeout_s))


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)
                ) -> dict[str, float | None]:
    """``{"p50": ..., "p90": ..., "p99": ...}`` (nearest rank), ``None`` without values."""
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for q in qs:
        out[f"p{q}"] = (ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]
                        if ordered else None)
    return out


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Counts by outcome and tag, latency percentiles of the requests that ran to the end."""
    finished = [r for r in results if r.ok and not r.cancelled and r.status == 200]
    by_tag: dict[str, dict[str, int]] = {}
    for r in results:
        row = by_tag.setdefault(r.tag, {"requests": 0, "errors": 0, "cancelled": 0})
        row["requests"] += 1
        row["errors"] += not r.ok
        row["cancelled"] += r.cancelled
    return {
        "requests": len(results),
        "errors": sum(not r.ok for r in results),
        "cancelled": sum(r.cancelled for r in results),
        "finished": len(finished),
        "wall_s": wall_s,
        "requests_per_s": len(results) / wall_s if wall_s else None,
        "latency_s": percentiles([r.latency_s for r in finished if r.latency_s is not None]),
        "ttft_s": percentiles([r.ttft_s for r in finished if r.ttft_s is not None]),
        "by_tag": by_tag,
        "first_errors": [asdict(r) for r in results if not r.ok][:5],
    }
