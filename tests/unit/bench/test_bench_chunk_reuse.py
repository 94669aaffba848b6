"""The chunk-reuse benchmark without an engine: dataset, layout, scoring, counters, ratios."""

from __future__ import annotations

import json
import random

import pytest

from tests.unit.bench.fake_tokenizer import FakeTokenizer, fake_essays
from vllm_accel import cli
from vllm_accel.bench import chunk_reuse
from vllm_accel.bench import chunk_reuse_workload as w
from vllm_accel.bench.features import plan_with_overrides
from vllm_accel.kv_connector.chunking import spans_from_separator

SEP = 1  # FakeTokenizer's <file_sep>


def _build(seed: int = 0, num_chunks=(4, 6), questions: int = 5, two: int = 2,
           tokenizer: FakeTokenizer | None = None) -> tuple[FakeTokenizer, w.Workload]:
    tok = tokenizer or FakeTokenizer()
    return tok, w.build(tok, num_chunks, 96, questions, two, seed, essays=fake_essays())


def test_dataset_is_deterministic():
    tok, first = _build(seed=3)
    _, again = _build(seed=3, tokenizer=tok)
    assert first == again
    _, other = _build(seed=4, tokenizer=tok)
    assert [d.code for d in other.documents] != [d.code for d in first.documents]
    # the questions of one document count do not depend on the other counts
    _, alone = _build(seed=3, num_chunks=(6,), tokenizer=tok)
    assert alone.by_num_chunks()[6] == first.by_num_chunks()[6]


def test_documents_carry_one_fact_each():
    tok, work = _build()
    docs = work.documents
    assert len(docs) == 6  # max(num_chunks)
    assert len({d.archive for d in docs}) == len({d.code for d in docs}) == 6
    assert len({d.essay for d in docs}) == 6 and all(d.essay != "gba.txt" for d in docs)
    for d in docs:
        sentence = w.fact(d.archive, d.code)
        assert d.text.count(sentence) == 1
        assert sentence == f"The access code of the {d.archive} archive is {d.code}."
        assert 3000 <= int(d.code) <= 9999
        assert tok.decode(list(d.token_ids)) == f"\n{d.text}\n"
        assert 60 <= len(d.token_ids) <= 140  # ~96-token slices, whole sentences, + the fact


def test_insert_fact_lands_at_a_sentence_start_mid_text():
    text = " ".join(f"Sentence {i} ends." for i in range(40))
    out = w.insert_fact(text, "The access code of the Kalo archive is 4821.", random.Random(0))
    at = out.index("The access code")
    assert 0.2 * len(text) <= at <= 0.8 * len(text)
    assert out[at - 2:at] == ". " and out.replace("The access code of the Kalo archive is 4821. ",
                                                  "") == text
    assert "4821" in w.insert_fact("no sentence boundary at all", "Code 4821.",
                                   random.Random(0))


def test_prompt_layout_separators_and_question_last():
    tok, work = _build()
    assert work.separator == "<file_sep>" and work.separator_id == SEP
    by_n = work.by_num_chunks()
    assert sorted(by_n) == [4, 6] and all(len(qs) == 5 for qs in by_n.values())
    for n, questions in by_n.items():
        assert sum(len(q.targets) == 2 for q in questions) == 2
        for q in questions:
            p = list(q.prompt)
            assert p.count(SEP) == n + 1 and len(set(q.order)) == n
            marks = [i for i, t in enumerate(p) if t == SEP]
            segments = [tuple(p[a + 1:b]) for a, b in zip(marks, marks[1:])]
            assert segments == [work.documents[d].token_ids for d in q.order]
            tail = tok.decode(p[marks[-1] + 1:])
            assert tail.startswith(f"Question: {q.text}")
            assert tail.endswith(w.answer_primer([work.documents[t].archive
                                                  for t in q.targets]))
            assert set(q.targets) <= set(q.order)
            assert q.expected == tuple(work.documents[t].code for t in q.targets)
            for t in q.targets:
                assert work.documents[t].archive in q.text
            # the connector sees the system prefix and one chunk per document
            spans = spans_from_separator(p, SEP)
            assert len(spans) == n + 1 and spans[-1].end == marks[-1]
    orders = [q.order for q in work.questions]
    assert len(set(orders)) == len(orders)  # new shuffled orders
    for doc, warm in zip(work.documents, work.warmup):
        assert list(warm).count(SEP) == 2
        assert tuple(warm[warm.index(SEP) + 1:len(warm) - warm[::-1].index(SEP) - 1]) \
            == doc.token_ids


def test_scoring_needs_every_code_as_a_whole_number():
    assert w.score(("4821",), " 4821.")
    assert w.score(("4821",), "The code is 4821 (Kalo)")
    assert not w.score(("4821",), " 14821.")
    assert not w.score(("4821",), " 482")
    assert w.score(("4821", "3307"), " 3307 and 4821.")
    assert not w.score(("4821", "3307"), " 4821.")


LOG = """\
(Worker pid=1) INFO 12-01 07:45:30 [metrics.py:47] chunk reuse (worker): saved_bytes=4.249e+07, \
saved_chunks=5; stores: {'memory': {'hits': 0.0, 'puts': 5.0}, 'total': {'hits': 0.0}}
(Worker pid=1) INFO 12-01 07:45:33 [metrics.py:47] chunk reuse (worker): \
claimed_token_layers=5.376e+04, recompute_fraction=0.05413, recompute_token_layers=2910, \
saved_chunks=5; stores: {'memory': {'hits': 9.0}, 'total': {'hits': 9.0, 'errors': 0.0}}
(EngineCore pid=2) INFO 12-01 07:45:36 [metrics.py:47] chunk reuse (scheduler): \
claimed_tokens=1792, hit_tokens=1792, miss_tokens=0, requests_with_chunks=3, reused_requests=2; \
stores: {'memory': {}, 'total': {}}
"""


def test_connector_counters_from_the_log():
    counters = chunk_reuse.connector_counters(LOG)
    assert counters["worker"]["recompute_fraction"] == pytest.approx(0.05413)
    assert counters["worker"]["saved_chunks"] == 5
    assert counters["scheduler"] == {"claimed_tokens": 1792, "hit_tokens": 1792,
                                     "miss_tokens": 0, "requests_with_chunks": 3,
                                     "reused_requests": 2}
    assert chunk_reuse.recompute_fraction(counters) == pytest.approx(0.05413)
    naive = {"worker": {"saved_chunks": 5}, "scheduler": {"reused_requests": 2}}
    assert chunk_reuse.recompute_fraction(naive) == 0.0
    assert chunk_reuse.recompute_fraction({"scheduler": {"reused_requests": 0}}) is None
    assert chunk_reuse.recompute_fraction({}) is None
    assert chunk_reuse.logged_store_stats(LOG)["total"] == {"hits": 9.0, "errors": 0.0}
    assert chunk_reuse.logged_store_stats("no counters") is None


def _fake_raw(work: w.Workload, ttft: float, right: bool, prefix_hits: int = 0) -> dict:
    """A worker result: every prompt answered in ``ttft`` s, with the right codes or not."""
    tasks = {}
    for n, questions in work.by_num_chunks().items():
        tasks[f"chunks_{n}"] = [
            {"prompt_tokens": len(q.prompt), "output_tokens": 3, "ttft_s": ttft, "tpot_s": 0.01,
             "token_ids": [100 + int(c) if right else 99 for c in q.expected] + [0, 98]}
            for q in questions]
    return {"vllm_version": "0.32.0", "platform": {"device": "cpu", "cpus": 2}, "load_s": 1.0,
            "tasks": tasks, "events": {f"chunks_{n}": {"prefix_cache_hit_tokens": prefix_hits}
                                       for n in work.by_num_chunks()}}


def _decode(ids: list[int]) -> str:
    return " ".join(str(i - 100) if i >= 1000 else "x" for i in ids)


def test_ratios_quality_table_and_plot(tmp_path):
    _, work = _build()
    eos = frozenset({0})
    blend_counters = chunk_reuse.connector_counters(LOG)
    default = chunk_reuse.DEFAULT_POLICY
    sides = {
        "full": chunk_reuse.summarize_side(_fake_raw(work, 2.0, True), work, _decode, eos),
        "prefix_cache": chunk_reuse.summarize_side(_fake_raw(work, 1.6, True, 512), work,
                                                   _decode, eos),
        "naive": chunk_reuse.summarize_side(_fake_raw(work, 0.4, False), work, _decode, eos,
                                            {"scheduler": {"reused_requests": 10}}),
        default: chunk_reuse.summarize_side(_fake_raw(work, 0.5, True), work, _decode, eos,
                                            blend_counters),
    }
    # tokens after EOS (98) are not part of the answer
    assert all("98" not in a["output"] for a in sides["full"]["answers"])
    assert sides["full"]["accuracy"] == 1.0 and sides["naive"]["accuracy"] == 0.0
    assert sides["naive"]["recompute_fraction"] == 0.0
    assert sides["prefix_cache"]["by_num_chunks"][6]["prefix_cache_hit_tokens"] == 512
    ratios, quality = chunk_reuse.compare(sides)
    assert ratios["headline_num_chunks"] == 6
    assert ratios["ttft_speedup"] == pytest.approx(4.0)
    assert ratios["ttft_speedup_by_side"] == {"prefix_cache": pytest.approx(1.25),
                                              "naive": pytest.approx(5.0),
                                              default: pytest.approx(4.0)}
    assert ratios["ttft_speedup_by_num_chunks"][4][default] == pytest.approx(4.0)
    assert quality["accuracy_full"] == 1.0 and quality["accuracy_reuse"] == 1.0
    assert quality["accuracy_naive"] == 0.0 and quality["accuracy_prefix_cache"] == 1.0
    assert quality["accuracy_by_num_chunks"][4]["naive"] == 0.0
    result = {"model": "m", "vllm_version": "0.32.0", "platform": {"device": "cpu", "cpus": 2},
              "config": {"plan": {"num_chunks": [4, 6], "chunk_tokens": 96, "questions": 5,
                                  "two_doc_questions": 2, "dtype": "float32"}},
              "sides": sides, "ratios": ratios, "quality": quality, "date": "today",
              "load_average": {"before": 1.5, "after": 2.0}}
    text = chunk_reuse.table(result)
    assert f"{default} 4.00x" in text and "5.4%" in text and "load average 1.5" in text
    assert f"accuracy: full 100%, {default} (default policy) 100%" in text
    json.dumps(result)
    pytest.importorskip("matplotlib")
    chunk_reuse.write_plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_ratios_without_the_default_policy():
    _, work = _build(num_chunks=(4,))
    sides = {"full": chunk_reuse.summarize_side(_fake_raw(work, 1.0, True), work, _decode),
             "epic": chunk_reuse.summarize_side(_fake_raw(work, 0.5, True), work, _decode)}
    ratios, quality = chunk_reuse.compare(sides)
    assert ratios["ttft_speedup"] is None and quality["accuracy_reuse"] is None
    assert ratios["ttft_speedup_by_side"] == {"epic": pytest.approx(2.0)}


def test_sides_engines_and_tasks():
    plan = plan_with_overrides(chunk_reuse.QUICK, ["sides=epic,query,prefix_cache",
                                                   "num_chunks=4,8",
                                                   "stores=memory,disk:/tmp/x",
                                                   "recompute_ratio=0.3",
                                                   "query_draft_tokens=12"])
    assert plan.side_labels() == ["full", "prefix_cache", "epic", "query"]
    engines = chunk_reuse.side_engines(plan)
    assert "kv_transfer_config" not in engines["full"]
    assert engines["full"]["enable_prefix_caching"] is False
    assert engines["prefix_cache"]["enable_prefix_caching"] is True
    extra = engines["epic"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["recompute"] == "epic" and extra["stores"] == ["memory", "disk:/tmp/x"]
    assert extra["recompute_ratio"] == 0.3 and engines["epic"]["dtype"] == "float32"
    assert extra["query_draft_tokens"] == 0  # only the query policy drafts
    query = engines["query"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert query["recompute"] == "query" and query["query_draft_tokens"] == 12
    assert extra["log_interval_s"] == 0  # the last log line must count the last request
    quick = chunk_reuse.side_engines(chunk_reuse.QUICK)
    naive = quick["naive"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert naive["recompute"] == "none" and "attention_temperature" not in naive
    epic_ape = quick["epic_ape"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert epic_ape["recompute"] == "epic"
    assert epic_ape["attention_temperature"] == chunk_reuse.QUICK.attention_temperature
    _, work = _build(num_chunks=(4, 6))
    tasks = chunk_reuse.tasks(plan, work)
    assert tasks[0]["name"] == "warmup" and tasks[0]["max_tokens"] == 1
    assert len(tasks[0]["prompts"]) == 6 and tasks[0]["sequential"]
    assert [t["name"] for t in tasks[1:]] == ["chunks_4", "chunks_6"]
    assert all(t["kind"] == "latency" and t["max_tokens"] == 16 for t in tasks[1:])
    assert chunk_reuse.max_model_len(plan, work) % 256 == 0
    assert chunk_reuse.max_model_len(plan, work) >= work.max_prompt_tokens + 16


def test_plan_checks_and_cli_errors(capsys):
    assert chunk_reuse.FULL.num_chunks == (4, 8, 10) and chunk_reuse.FULL.chunk_tokens == 1024
    with pytest.raises(ValueError, match="sides: unknown \\['turbo'\\]"):
        plan_with_overrides(chunk_reuse.QUICK, ["sides=turbo"])
    with pytest.raises(ValueError, match="two_doc_questions"):
        plan_with_overrides(chunk_reuse.QUICK, ["questions=2", "two_doc_questions=3"])
    assert cli.main(["bench", "chunk-reuse", "--quick", "--set", "sides=turbo"]) == 2
    assert "sides: unknown ['turbo']" in capsys.readouterr().err
    assert cli.main(["bench", "chunk-reuse", "--quick", "--model", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_real_tokenizer_layout():
    """SmolLM2's tokenizer (when fetched): its <file_sep> separates the chunks, the chat
    template frames the prompt."""
    from vllm_accel.models import DEFAULT_MODEL, ModelNotFetchedError, model_path
    from vllm_accel.quality.prompts import load_tokenizer

    try:
        tok = load_tokenizer(str(model_path(DEFAULT_MODEL)))
    except ModelNotFetchedError as exc:
        pytest.skip(str(exc))
    work = w.build(tok, (3,), 128, 2, 1, essays=fake_essays())
    assert work.separator == "<file_sep>"
    for q in work.questions:
        text = tok.decode(list(q.prompt))
        assert text.startswith("<|im_start|>system") and text.count("<file_sep>") == 4
        assert text.endswith(w.answer_primer([work.documents[t].archive for t in q.targets]))
