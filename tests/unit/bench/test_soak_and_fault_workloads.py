"""The soak's and the fault run's request streams, fault schedule and file corruption (no
vLLM)."""

from __future__ import annotations

import random

from vllm_accel.bench import fault_run
from vllm_accel.bench.soak_workload import MAX_TOKENS, soak_requests

ESSAYS = {f"e{i}.txt": " ".join(f"Sentence {i}.{j} is about topic {j % 7}." for j in range(400))
          for i in range(6)}
SEP = "<file_sep>"


def test_soak_stream_is_seeded_mixed_and_fits_the_context():
    a = soak_requests(300, "m", SEP, ESSAYS, seed=1)
    assert [r.body for r in a] == [r.body for r in soak_requests(300, "m", SEP, ESSAYS, seed=1)]
    assert [r.body for r in a] != [r.body for r in soak_requests(300, "m", SEP, ESSAYS, seed=2)]
    tags = {t: sum(r.tag == t for r in a) for t in ("rag", "completion", "chat", "short")}
    assert all(n > 20 for n in tags.values()), tags
    assert 60 < sum(r.stream for r in a) < 240
    cancels = [r for r in a if r.cancels]
    assert 10 < len(cancels) < 60
    assert all((r.cancel_after_chunks is not None) == r.stream for r in cancels)
    for r in a:
        assert "seed" not in r.body  # vLLM 0.32 CPU crashes on seeded chunked prefills
        assert r.body["model"] == "m" and r.body["max_tokens"] in MAX_TOKENS
        text = r.body.get("prompt") or r.body["messages"][0]["content"]
        assert len(text) < 4 * (2048 - max(MAX_TOKENS)) * 0.9  # ~4 characters per token
        if r.tag == "rag":
            assert 3 <= text.count(SEP) <= 5


def test_fault_stream_expects_400_for_malformed_and_oversize_requests():
    stream = fault_run.fault_requests(120, SEP, ESSAYS)
    by_tag = {t: [r for r in stream if r.tag == t] for t in
              ("malformed", "oversize", "document", "short")}
    assert len(by_tag["malformed"]) == 10 and len(by_tag["oversize"]) == 4  # 6 less 2 shared
    assert all(r.expect_status == 400 for r in by_tag["malformed"] + by_tag["oversize"])
    assert all(r.body["kv_transfer_params"]["chunk_spans"][0][1] == 1
               for r in by_tag["malformed"])
    assert all(len(r.body["prompt"]) > 4 * 2048 for r in by_tag["oversize"])
    assert all(r.body["prompt"].count(SEP) == 2 and r.body["temperature"] == 0.0
               for r in by_tag["document"])
    assert len(by_tag["document"]) > 60 and by_tag["short"]


def test_schedule_runs_each_action_once_at_its_point():
    calls = []

    def kill():
        calls.append("kill")

    def restart():
        calls.append("restart")

    on_progress, log = fault_run._schedule(10, {0.2: kill, 0.5: restart})
    for done in range(1, 11):
        on_progress(done)
        if done == 1:
            assert calls == []
    assert calls == ["kill", "restart"]
    assert [(e["at_request"], e["action"]) for e in log] == [(2, "kill"), (5, "restart")]


def test_corrupt_files_changes_every_chunk_file(tmp_path):
    originals = {}
    for i in range(5):
        path = tmp_path / f"{i:02d}" / f"k{i}.chunk"
        path.parent.mkdir()
        path.write_bytes(bytes(range(256)) * 8)
        originals[path] = path.read_bytes()
    (tmp_path / "other.txt").write_text("left alone")
    assert fault_run.corrupt_files(tmp_path, random.Random(0)) == 5
    assert all(path.read_bytes() != blob for path, blob in originals.items())
    assert (tmp_path / "other.txt").read_text() == "left alone"
