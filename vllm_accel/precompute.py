"""``vllm-accel precompute``: fill a chunk store for ``ChunkReuseConnector`` ahead of time.

Each ``*.txt`` / ``*.md`` file of a directory (sorted by name) becomes one chunk: the file's
exact text, tokenized on its own, after the separator token. An engine with the connector runs
``SEP + document + SEP`` for each file (one generated token); the connector saves every chunk it
has not seen into the stores. The stores must include a persistent one (``disk:/path`` or
``redis://...``): a memory store dies with the process.

A later prompt hits a precomputed document when it holds ``SEP + <the file's exact text> + SEP``
(the next separator may start another document or the question) and its engine uses the same
model, dtype, KV-cache dtype, ``chunk_separator`` and store, without a different
``cache_salt``. The separator is a special token, so a prompt sent as text tokenizes the
document between two separators exactly as here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

DOC_SUFFIXES = (".txt", ".md")
PERSISTENT_PREFIXES = ("disk:", "redis://", "rediss://")

EPILOG = """\
how a later prompt hits a precomputed document:
  Put the document's exact text (the whole file, byte for byte, nothing added or stripped)
  between two separator tokens, e.g. for Qwen2.5-Coder (separator <|file_sep|>):

    <system text><|file_sep|>{contents of a.md}<|file_sep|>{contents of b.txt}<|file_sep|>{question}

  Every separator-started segment followed by another separator is a chunk, in any order and at
  any position; the text after the last separator is always computed. A prompt sent as text
  tokenizes a document between two separators exactly as here (the separator is a special token).
  Chunks are keyed by their tokens and a fingerprint of the model: the serving engine must load
  the same model given the same way (path or name), with the same --dtype and KV-cache dtype,
  the same chunk_separator and the same store, e.g.

    vllm-accel serve MODEL --kv-transfer-config '{"kv_connector": "ChunkReuseConnector",
      "kv_connector_module_path": "vllm_accel.kv_connector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"stores": ["memory", "disk:/data/chunks"]}}'

  A prompt reuses its chunks only when they cover min_reuse_tokens (default 64) together.
  Requests with a cache_salt only hit chunks saved with the same salt (none here).
"""


class PrecomputeError(ValueError):
    """Bad arguments: the message names the flag and what is accepted."""


class EngineFailed(RuntimeError):
    """The engine failed to start or to run; the message ends with the log's last lines."""


@dataclass(frozen=True)
class Document:
    path: Path
    token_ids: tuple[int, ...]


def check_stores(stores: list[str]) -> list[str]:
    """The ``--stores`` list, checked: known forms, at least one persistent store."""
    stores = [s.strip() for s in stores if s.strip()]
    for spec in stores:
        if spec != "memory" and not (spec.startswith(PERSISTENT_PREFIXES)
                                     and spec.split(":", 1)[1].strip("/")):
            raise PrecomputeError(f"--stores {spec!r}: expected 'memory', 'disk:/path' or "
                                  f"'redis://host:port/db'")
    if not any(s.startswith(PERSISTENT_PREFIXES) for s in stores):
        raise PrecomputeError("--stores must name a persistent store (disk:/path or "
                              "redis://host:port/db): a memory store dies with this process")
    # absolute disk paths: the serving engine may start in another directory
    return [f"disk:{Path(s[len('disk:'):].strip()).expanduser().resolve()}"
            if s.startswith("disk:") else s for s in stores]


def find_documents(docs_dir: str | Path) -> list[Path]:
    """The ``*.txt`` / ``*.md`` files directly in ``docs_dir``, sorted by name."""
    root = Path(docs_dir)
    if not root.is_dir():
        raise PrecomputeError(f"--docs {docs_dir}: not a directory")
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in DOC_SUFFIXES)
    if not files:
        raise PrecomputeError(f"--docs {docs_dir}: no *.txt or *.md files in it")
    return files


def chunk_prompt(separator_id: int, doc_ids: tuple[int, ...] | list[int]) -> list[int]:
    """``SEP + document + SEP``: the document is the prompt's one chunk."""
    return [separator_id, *doc_ids, separator_id]


def tokenize_documents(tokenizer: Any, paths: list[Path], separator_id: int
                       ) -> tuple[list[Document], list[str]]:
    """The documents' token ids (their exact text), and why files were skipped."""
    docs, skipped = [], []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            skipped.append(f"{path.name}: not readable as UTF-8 ({type(exc).__name__})")
            continue
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            skipped.append(f"{path.name}: empty")
        elif separator_id in ids:
            skipped.append(f"{path.name}: contains the separator token, so it would be split "
                           f"into several chunks")
        else:
            docs.append(Document(path, ids))
    return docs, skipped


def kv_transfer_config(stores: list[str], recompute: str, separator: str) -> dict[str, Any]:
    return {"kv_connector": "ChunkReuseConnector",
            "kv_connector_module_path": "vllm_accel.kv_connector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"stores": list(stores), "recompute": recompute,
                                          "chunk_separator": separator,
                                          "save_new_chunks": True}}


def disk_chunk_count(stores: list[str]) -> dict[str, int]:
    """Chunk files in each disk store (``<path>/<key[:2]>/<key>.chunk``)."""
    out = {}
    for spec in stores:
        if spec.startswith("disk:"):
            root = Path(spec[len("disk:"):].strip())
            out[str(root)] = sum(1 for _ in root.glob("*/*.chunk")) if root.is_dir() else 0
    return out


@contextlib.contextmanager
def engine_output_to(log_path: Path) -> Iterator[tuple[TextIO, TextIO]]:
    """Send this process's stdout/stderr (and the engine processes it starts) to ``log_path``;
    yield streams on the original stdout and stderr for the progress bar and messages."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    out = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    err = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    with log_path.open("ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield out, err
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            out.close()
            err.close()


def _prefill(model_dir: str, docs: list[Document], separator_id: int, progress: TextIO,
             **engine: Any) -> None:
    """One engine; ``SEP + document + SEP`` for each document (one token generated), then a
    shutdown, so that the workers log their final counters."""
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, **engine)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for doc in tqdm(docs, desc="precompute", unit="doc", file=progress):
        prompt = TokensPrompt(prompt_token_ids=chunk_prompt(separator_id, doc.token_ids))
        llm.generate([prompt], params, use_tqdm=False)
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()


@dataclass
class PrecomputeResult:
    documents: int
    skipped: list[str]
    saved_chunks: int | None  # the connector's worker counter (None: not logged)
    already_stored: int | None  # documents not saved: the store had their chunk
    store_stats: dict[str, Any] | None  # the stores' counters in the worker (bytes, errors)
    disk_chunks: dict[str, tuple[int, int]]  # disk store path -> (chunk files before, after)
    seconds: float
    log_path: Path
    counters: dict[str, dict[str, float]]


def run(model_dir: str, docs_dir: str, stores: list[str], recompute: str = "epic",
        separator: str = "auto", dtype: str = "auto", max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.3, log_path: Path = Path("precompute.log")
        ) -> PrecomputeResult:
    from vllm_accel.bench.chunk_reuse import connector_counters, logged_store_stats
    from vllm_accel.cpu_env import apply_cpu_thread_env
    from vllm_accel.kv_connector.separator import separator_from_tokenizer
    from vllm_accel.quality.prompts import load_tokenizer

    stores = check_stores(stores)
    paths = find_documents(docs_dir)
    tokenizer = load_tokenizer(model_dir)
    try:
        separator_id = separator_from_tokenizer(tokenizer, separator)
    except ValueError as exc:
        raise PrecomputeError(str(exc).replace(
            "--kv-transfer-config kv_connector_extra_config.chunk_separator",
            "--chunk-separator")) from None
    docs, skipped = tokenize_documents(tokenizer, paths, separator_id)
    if not docs:
        raise PrecomputeError(f"--docs {docs_dir}: no usable document ({'; '.join(skipped)})")
    longest = max(len(d.token_ids) for d in docs) + 2
    length = max_model_len or -(-(longest + 16) // 256) * 256
    if longest + 1 > length:
        raise PrecomputeError(f"--max-model-len {length}: the longest document needs "
                              f"{longest + 1} tokens")
    before = disk_chunk_count(stores)
    apply_cpu_thread_env()
    started = time.perf_counter()
    log_path = Path(log_path)
    log_path.unlink(missing_ok=True)
    with engine_output_to(log_path) as (_, err):
        print(f"engine log: {log_path}", file=err)
        try:
            _prefill(model_dir, docs, separator_id, err, dtype=dtype, max_model_len=length,
                     enforce_eager=True, enable_prefix_caching=False,
                     gpu_memory_utilization=gpu_memory_utilization, seed=0,
                     kv_transfer_config=kv_transfer_config(stores, recompute, separator))
        except Exception as exc:  # noqa: BLE001 - reported with the engine log's tail
            failure = f"{type(exc).__name__}: {exc}"
        else:
            failure = None
    if failure is not None:
        tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-15:])
        raise EngineFailed(f"the engine failed ({failure}); log {log_path}, last lines:\n"
                           f"{tail}")
    log = log_path.read_text(errors="replace")
    counters = connector_counters(log)
    worker = counters.get("worker")
    # None: the worker logged no counters (it logs them once it has any), so unknown
    saved = int(worker.get("saved_chunks", 0)) if worker is not None else None
    after = disk_chunk_count(stores)
    return PrecomputeResult(
        documents=len(docs), skipped=skipped, saved_chunks=saved,
        already_stored=len(docs) - saved if saved is not None else None,
        store_stats=logged_store_stats(log),
        disk_chunks={k: (before.get(k, 0), v) for k, v in after.items()},
        seconds=time.perf_counter() - started, log_path=log_path, counters=counters)
