"""``vllm-accel precompute`` without an engine: arguments, documents, prompts, output capture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.unit.bench.fake_tokenizer import FakeTokenizer
from vllm_accel import cli, precompute
from vllm_accel.kv_connector.chunking import spans_from_separator


def test_stores_need_a_persistent_one():
    assert precompute.check_stores(["memory", "disk:/data/chunks"]) == ["memory",
                                                                       "disk:/data/chunks"]
    assert precompute.check_stores(["redis://localhost:6379/0"]) == ["redis://localhost:6379/0"]
    assert precompute.check_stores(["disk:chunks"]) == [f"disk:{Path('chunks').resolve()}"]
    with pytest.raises(precompute.PrecomputeError, match="persistent"):
        precompute.check_stores(["memory"])
    for bad in ("disk:", "s3://bucket", "disk"):
        with pytest.raises(precompute.PrecomputeError, match="expected 'memory'"):
            precompute.check_stores([bad])


def test_documents_are_txt_and_md_files_sorted(tmp_path):
    for name in ("b.md", "a.txt", "c.json", "d.txt"):
        (tmp_path / name).write_text(name)
    (tmp_path / "sub.txt").mkdir()
    assert [p.name for p in precompute.find_documents(tmp_path)] == ["a.txt", "b.md", "d.txt"]
    with pytest.raises(precompute.PrecomputeError, match="no \\*.txt or \\*.md"):
        precompute.find_documents(tmp_path / "sub.txt")
    with pytest.raises(precompute.PrecomputeError, match="not a directory"):
        precompute.find_documents(tmp_path / "missing")


def test_prompt_is_one_chunk_of_the_exact_text(tmp_path):
    tok = FakeTokenizer()
    (tmp_path / "a.txt").write_text("First document.\n")
    (tmp_path / "b.md").write_text("")
    (tmp_path / "c.txt").write_text("has a <file_sep> inside")
    (tmp_path / "d.txt").write_bytes(b"\xff\xfe not utf-8")
    docs, skipped = precompute.tokenize_documents(tok, precompute.find_documents(tmp_path), 1)
    assert [d.path.name for d in docs] == ["a.txt"]
    assert [s.split(":")[0] for s in skipped] == ["b.md", "c.txt", "d.txt"]
    assert tok.decode(list(docs[0].token_ids)) == "First document.\n"
    prompt = precompute.chunk_prompt(1, docs[0].token_ids)
    assert prompt == [1, *docs[0].token_ids, 1]
    spans = spans_from_separator(prompt, 1)  # what the connector saves: SEP + the document
    assert [(s.start, s.end) for s in spans] == [(0, len(prompt) - 1)]
    # a later prompt with the same text between separators has the same chunk tokens
    later = tok.encode("System.<file_sep>First document.\n<file_sep>Question?")
    first = later.index(1)
    assert later[first:first + len(prompt) - 1] == prompt[:-1]


def test_connector_config_and_disk_count(tmp_path):
    config = precompute.kv_transfer_config(["disk:/x"], "epic", "auto")
    assert config["kv_connector"] == "ChunkReuseConnector"
    assert config["kv_connector_extra_config"] == {"stores": ["disk:/x"], "recompute": "epic",
                                                   "chunk_separator": "auto",
                                                   "save_new_chunks": True}
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "abcd.chunk").write_bytes(b"x")
    (tmp_path / "ab" / ".abcd.tmp").write_bytes(b"x")
    assert precompute.disk_chunk_count([f"disk:{tmp_path}", "memory"]) == {str(tmp_path): 1}


def test_cli_arguments(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("doc")
    args = cli.build_parser().parse_args(
        ["precompute", "--model", "smollm2", "--docs", str(tmp_path), "--stores", "memory",
         f"disk:{tmp_path}/store", "--recompute", "cacheblend"])
    assert args.stores == ["memory", f"disk:{tmp_path}/store"]
    assert (args.recompute, args.dtype, args.chunk_separator) == ("cacheblend", "auto", "auto")
    assert cli.main(["precompute", "--model", "smollm2", "--docs", str(tmp_path),
                     "--stores", "memory"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "persistent store" in err
    assert cli.main(["precompute", "--model", "smollm2", "--docs", str(tmp_path / "none"),
                     "--stores", "disk:/tmp/x"]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --stores is required
        cli.build_parser().parse_args(["precompute", "--model", "m", "--docs", "d"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["precompute", "--help"])
    assert "between two separator tokens" in capsys.readouterr().out


def test_engine_output_goes_to_the_log(tmp_path, capfd):
    log = tmp_path / "logs" / "engine.log"
    with precompute.engine_output_to(log) as (out, err):
        os.write(1, b"engine stdout\n")
        os.write(2, b"engine stderr\n")
        print("progress", file=err)
        print("result", file=out)
    os.write(1, b"after\n")
    captured = capfd.readouterr()
    assert "engine" not in captured.out + captured.err
    assert "progress" in captured.err and "result" in captured.out and "after" in captured.out
    assert log.read_text() == "engine stdout\nengine stderr\n"
