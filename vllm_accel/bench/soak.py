"""``vllm-accel soak``: the OpenAI server with every composable feature on, under load, next
to plain vLLM with the same load, in the same run.

Each side is one ``vllm-accel serve`` (float32, prefix caching and chunked prefill on, 512-token
steps so long prompts are split). ``plain`` is vLLM alone; ``accel`` adds the largest set the
composition matrix allows (:data:`vllm_accel.composition.FULL_SET`): ``ACCEL_SPARSE_PREFILL``
(from 256 tokens of context, so the soak's long prompts use it), ``ChunkReuseConnector``
(memory + disk stores, EPIC recompute) and ``HybridProposer`` (SAM or recycled drafts of up
to 4 tokens where they pay off). Both get the same
seeded stream (:mod:`.soak_workload`) from ``concurrency`` closed-loop clients. Per side:
errors (a failed request, an unexpected status, a response that ended without a finish reason;
client cancellations are not errors), latency and TTFT percentiles, the server's resident
memory (its whole process tree, sampled every second) after the first quarter of the requests
and at the end, a probe answered the same before and after the load, and the feature counters
from ``/metrics``. ``ratios`` compare each side to plain. The single features are sides too
(``sparse``, ``reuse``, ``proposer``), to tell what costs what.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_accel.bench.chunk_reuse import CONNECTOR
from vllm_accel.bench.openai_load import LoadRequest, run_load, summarize
from vllm_accel.bench.report import save_figure
from vllm_accel.bench.server import Server, engine_flags, metric_total, read_metrics, served
from vllm_accel.bench.soak_workload import probe_request, separator_text, soak_requests
from vllm_accel.bench.spec_decode import PROPOSER_CLASSES
from vllm_accel.log import get_logger

logger = get_logger("soak")

SERVED_NAME = "m"
SIDES = ("plain", "sparse", "reuse", "proposer", "accel")
COMMON = {"dtype": "float32", "served_model_name": SERVED_NAME, "enable_prefix_caching": True,
          "enable_chunked_prefill": True, "max_num_batched_tokens": 512, "max_num_seqs": 8}
#: Counters read from /metrics at the end of each side (summed over labels).
METRICS = ("vllm:chunk_reuse_reused_requests_total", "vllm:chunk_reuse_hit_tokens_total",
           "vllm:chunk_reuse_saved_chunks_total", "vllm:chunk_reuse_load_failures_total",
           "vllm:chunk_reuse_store_errors_total", "vllm:spec_decode_num_draft_tokens_total",
           "vllm:spec_decode_num_accepted_tokens_total", "vllm:num_preemptions_total",
           "vllm:prefix_cache_hits_total")


def feature_engines(store_dir: str, memory_gb: float = 0.25) -> dict[str, dict[str, Any]]:
    """Engine settings of each feature of the full composable set (see the module docstring),
    and of the set itself (``accel``); ``plain`` has none."""
    features = {
        "sparse": {"attention_backend": "ACCEL_SPARSE_PREFILL",
                   "additional_config": {"vllm_accel": {"sparse_prefill": {"threshold": 256}}}},
        "reuse": {"kv_transfer_config": {
            **CONNECTOR,
            "kv_connector_extra_config": {"stores": ["memory", f"disk:{store_dir}"],
                                          "memory_gb": memory_gb, "recompute": "epic"}}},
        "proposer": {"speculative_config": {"method": "custom_class",
                                            "model": PROPOSER_CLASSES["hybrid"],
                                            "num_speculative_tokens": 4}},
    }
    accel = {k: v for engine in features.values() for k, v in engine.items()}
    return {"plain": {}, **features, "accel": accel}


@dataclass
class MemorySampler:
    """The server's resident memory every ``interval_s`` in a thread, with the number of
    requests done at the time."""

    server: Server
    interval_s: float = 1.0
    done: int = 0
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (s, done, bytes)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> MemorySampler:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        self.samples.append((time.monotonic() - self._t0, self.done, self.server.rss_bytes()))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def report(self, total: int) -> dict[str, float]:
        mib = 1 << 20
        settled = [rss for _, done, rss in self.samples if done >= total // 4]
        return {"rss_settled_mib": settled[0] / mib if settled else None,
                "rss_peak_mib": max(rss for *_, rss in self.samples) / mib,
                "rss_end_mib": self.samples[-1][2] / mib,
                "growth_after_settled_mib": (self.samples[-1][2] - settled[0]) / mib
                if settled else None,
                "samples": [(round(t, 1), done, round(rss / mib)) for t, done, rss in
                            self.samples]}


def _probe(server: Server) -> str:
    [result] = run_load(server.url, [probe_request(SERVED_NAME)], 1)
    if not result.ok:
        raise RuntimeError(f"the probe request failed: {result.error}")
    return result.text


def run_side(label: str, model: str, engine: dict[str, Any], requests: list[LoadRequest],
             concurrency: int, log_dir: Path) -> dict[str, Any]:
    """One server, the probe, the load, the probe again; the side's report."""
    flags = engine_flags({**COMMON, **engine})
    logger.info("soak %s: %d requests at concurrency %d", label, len(requests), concurrency)
    with served(model, flags, log_dir / f"soak-{label}.log") as server:
        probe_before = _probe(server)
        with MemorySampler(server) as memory:
            def progress(done: int) -> None:
                memory.done = done

            started = time.perf_counter()
            results = run_load(server.url, requests, concurrency, on_progress=progress)
            wall_s = time.perf_counter() - started
        probe_after = _probe(server)
        samples = read_metrics(server.url)
    report = summarize(results, wall_s)
    report.update(memory=memory.report(len(requests)), probe_before=probe_before,
                  probe_after=probe_after, probe_stable=probe_before == probe_after,
                  metrics={m: metric_total(samples, m) for m in METRICS},
                  flags=flags)
    return report


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ratios(side: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """The side's latency, TTFT and throughput over plain vLLM's (the same load)."""
    out: dict[str, Any] = {f"{what}_{q}_over_plain": _ratio(side[what][q], plain[what][q])
                           for what in ("latency_s", "ttft_s") for q in ("p50", "p90", "p99")}
    out["throughput_over_plain"] = _ratio(side["requests_per_s"], plain["requests_per_s"])
    out["probe_same_as_plain"] = side["probe_after"] == plain["probe_after"]
    return out


def run(model: str, requests: int = 200, concurrency: int = 8, seed: int = 0,
        log_dir: str | Path = "results/logs", sides: tuple[str, ...] = ("plain", "accel")
        ) -> dict[str, Any]:
    """Every side with the same request stream; the report (JSON-ready)."""
    from vllm_accel.quality.data import essays

    stream = soak_requests(requests, SERVED_NAME, separator_text(model), essays(), seed=seed)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"model": model, "requests": requests, "concurrency": concurrency,
                           "seed": seed, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                               time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="vllm-accel-soak-") as store_dir:
        engines = feature_engines(store_dir)
        unknown = sorted(set(sides) - set(engines))
        if unknown:
            raise ValueError(f"--sides: unknown {', '.join(unknown)}; choose from "
                             f"{', '.join(engines)}")
        for side in sides:
            out[side] = run_side(side, model, engines[side], stream, concurrency, log_dir)
    if "plain" in out:
        plain = out["plain"]
        out["ratios"] = {side: _ratios(out[side], plain) for side in sides if side != "plain"}
    return out


def table(report: dict[str, Any]) -> str:
    """A Markdown table of the sides' numbers (the docs' soak section)."""
    sides = [s for s in SIDES if s in report]
    rows = [("requests / errors / cancelled",
             lambda r: f"{r['requests']} / {r['errors']} / {r['cancelled']}"),
            ("latency p50 / p90 / p99 (s)",
             lambda r: " / ".join(f"{r['latency_s'][q]:.2f}" for q in ("p50", "p90", "p99"))),
            ("TTFT p50 / p90 / p99 (s, streamed)",
             lambda r: " / ".join(f"{r['ttft_s'][q]:.2f}" for q in ("p50", "p90", "p99"))),
            ("requests/s", lambda r: f"{r['requests_per_s']:.2f}"),
            ("RSS settled -> end (MiB)", lambda r: f"{r['memory']['rss_settled_mib']:.0f} -> "
                                                   f"{r['memory']['rss_end_mib']:.0f}"),
            ("probe unchanged", lambda r: str(r["probe_stable"]))]
    lines = ["| | " + " | ".join(sides) + " |", "|---" * (len(sides) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(fmt(report[s]) for s in sides) + " |"
              for name, fmt in rows]
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str | Path) -> None:
    """Latency percentiles per side, and each server's resident memory over the requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [s for s in SIDES if s in report]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / 3
    for j, q in enumerate(("p50", "p90", "p99")):
        axes[0].bar([i + (j - 1) * width for i in range(len(sides))],
                    [report[s]["latency_s"][q] for s in sides], width, label=q)
    axes[0].set_xticks(range(len(sides)), sides)
    axes[0].set_ylabel("request latency (s)")
    axes[0].set_title(f"latency, {report['requests']} requests at concurrency "
                      f"{report['concurrency']}")
    axes[0].legend()
    for s in sides:
        samples = report[s]["memory"].get("samples") or []
        axes[1].plot([done for _, done, _ in samples], [mib for *_, mib in samples], label=s)
    axes[1].set_xlabel("requests done")
    axes[1].set_ylabel("server RSS (MiB)")
    axes[1].set_title("resident memory of the server's processes")
    axes[1].legend()
    save_figure(fig, f"vllm-accel soak, {Path(report['model']).name}, {report['date']}", path)


def main(model: str, json_path: str | None, plot_path: str | None = None, **kwargs: Any
         ) -> int:
    report = run(model, **kwargs)
    print(table(report))
    if plot_path:
        write_plot(report, plot_path)
    if "ratios" in report:
        print(json.dumps(report["ratios"], indent=1))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1))
    failed = [s for s in SIDES if s in report
              and (report[s]["errors"] or not report[s]["probe_stable"])]
    return 1 if failed else 0
