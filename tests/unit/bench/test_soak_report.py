"""The soak's report: ratios to plain vLLM, the Markdown table, the plot (no vLLM)."""

from __future__ import annotations

from vllm_accel.bench import soak


def side(latency: float, rps: float, probe: str = "same") -> dict:
    pct = {"p50": latency, "p90": 2 * latency, "p99": 3 * latency}
    return {"requests": 10, "errors": 0, "cancelled": 1, "latency_s": pct,
            "ttft_s": {k: v / 10 for k, v in pct.items()}, "requests_per_s": rps,
            "probe_before": probe, "probe_after": probe, "probe_stable": True,
            "memory": {"rss_settled_mib": 100.0, "rss_end_mib": 110.0,
                       "samples": [(0.0, 0, 90), (1.0, 5, 100), (2.0, 10, 110)]}}


def test_ratios_table_and_plot(tmp_path):
    report = {"model": "/m/smollm2", "requests": 10, "concurrency": 2, "date": "today",
              "plain": side(1.0, 2.0), "accel": side(2.0, 1.0, probe="other")}
    ratios = soak._ratios(report["accel"], report["plain"])
    assert ratios["latency_s_p90_over_plain"] == 2.0
    assert ratios["throughput_over_plain"] == 0.5
    assert ratios["probe_same_as_plain"] is False
    table = soak.table(report)
    assert table.splitlines()[0] == "| | plain | accel |"
    assert "| latency p50 / p90 / p99 (s) | 1.00 / 2.00 / 3.00 | 2.00 / 4.00 / 6.00 |" in table
    soak.write_plot(report, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").read_bytes()[:4] == b"\x89PNG"
