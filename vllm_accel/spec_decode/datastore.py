"""Datastores for SAMProposer: a frozen suffix automaton over a tokenized text corpus.

``vllm-accel datastore build --model M --corpus PATHS... --out FILE`` (or :func:`build`) writes
two files:

* ``FILE``: the frozen :class:`~vllm_accel.spec_decode.suffix_automaton.SuffixAutomaton` over
  every corpus document's token ids, documents separated by the tokenizer's EOS token (so no
  match runs from one document into the next);
* ``FILE.manifest.json``: what it was built from and for: the tokenizer's identity (vocabulary
  size and a SHA-256 over its token->id map and BPE merges), the token count, every source file
  with its own hash, and the automaton file's size and hash.

Token ids only mean something for the tokenizer that produced them, so :func:`load` refuses a
datastore whose tokenizer identity differs from the serving model's, and a file that does not
match its manifest (truncated, replaced, corrupt). Its errors are one-line ``DatastoreError``
(a ``ValueError``) naming the ``datastore`` knob and the fix. This module does not import vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_accel.config import knob
from vllm_accel.spec_decode.suffix_automaton import SAMFormatError, SuffixAutomaton

FORMAT = "vllm-accel-sam-datastore/1"
MANIFEST_SUFFIX = ".manifest.json"
KNOB = knob("spec_decode", "datastore")


class DatastoreError(ValueError):
    """A datastore cannot be built or used (the message says which file and the fix)."""


@dataclass(frozen=True)
class TokenizerIdentity:
    """Which token ids mean what: two tokenizers with equal identities encode alike."""

    name: str  # informative only (a path or hub name); not compared
    vocab_size: int
    sha256: str

    def matches(self, other: TokenizerIdentity) -> bool:
        return self.vocab_size == other.vocab_size and self.sha256 == other.sha256


def tokenizer_identity(tokenizer: Any) -> TokenizerIdentity:
    """Identity of a Hugging Face tokenizer: its size and a hash of its vocabulary (added
    tokens included) and, for BPE tokenizers, its merges."""
    digest = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    for token, token_id in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{token_id}\t{token}\n".encode("utf-8", "surrogatepass"))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        merges = json.loads(backend.to_str()).get("model", {}).get("merges") or []
        digest.update(b"merges\n")
        for merge in merges:
            text = merge if isinstance(merge, str) else " ".join(merge)
            digest.update(text.encode("utf-8", "surrogatepass") + b"\n")
    name = str(getattr(tokenizer, "name_or_path", "") or "?")
    return TokenizerIdentity(name=name, vocab_size=len(tokenizer), sha256=digest.hexdigest())


def load_tokenizer(name_or_path: str, revision: str | None = None,
                   trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, revision=revision,
                                         trust_remote_code=trust_remote_code)


def manifest_path(path: str | os.PathLike) -> Path:
    return Path(str(path) + MANIFEST_SUFFIX)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def corpus_files(paths: list[str | os.PathLike]) -> list[Path]:
    """The files named, and every file under the directories named (sorted, hidden skipped)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file()
                            and not any(part.startswith(".") for part in p.relative_to(path).parts))
        else:
            raise DatastoreError(f"--corpus {raw}: no such file or directory")
    if not files:
        raise DatastoreError(f"--corpus {' '.join(map(str, paths))}: no files found")
    return files


@dataclass(frozen=True)
class BuildReport:
    out: Path
    manifest: Path
    num_tokens: int
    num_documents: int
    skipped: list[str]  # directory files that are not UTF-8 text
    num_states: int
    bytes: int
    seconds: float


def build(tokenizer: Any, paths: list[str | os.PathLike], out: str | os.PathLike) -> BuildReport:
    """Tokenize the corpus with ``tokenizer`` and write ``out`` and its manifest."""
    started = time.perf_counter()
    out = Path(out).expanduser()
    explicit = {Path(p).expanduser().resolve() for p in paths if Path(p).expanduser().is_file()}
    separator = getattr(tokenizer, "eos_token_id", None)
    sam = SuffixAutomaton()
    sources, skipped = [], []
    for path in corpus_files(paths):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            if path.resolve() in explicit:
                raise DatastoreError(f"--corpus {path}: not UTF-8 text") from None
            skipped.append(str(path))
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            continue
        if sources and separator is not None:
            sam.extend([separator])
        sam.extend(ids)
        sources.append({"path": str(path.resolve()), "tokens": len(ids),
                        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()})
    if not sources:
        raise DatastoreError(f"--corpus {' '.join(map(str, paths))}: no non-empty UTF-8 text")
    sam.freeze()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    sam.save(tmp)
    manifest = {
        "format": FORMAT,
        "tokenizer": asdict(tokenizer_identity(tokenizer)),
        "num_tokens": sam.num_tokens,
        "num_documents": len(sources),
        "separator_token": separator,
        "sources": sources,
        "automaton": {"bytes": tmp.stat().st_size, "sha256": _file_sha256(tmp),
                      "num_states": sam.num_states},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    manifest_tmp = Path(str(tmp) + MANIFEST_SUFFIX)
    manifest_tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out)
    os.replace(manifest_tmp, manifest_path(out))
    return BuildReport(out=out, manifest=manifest_path(out), num_tokens=sam.num_tokens,
                       num_documents=len(sources), skipped=skipped, num_states=sam.num_states,
                       bytes=manifest["automaton"]["bytes"],
                       seconds=time.perf_counter() - started)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of datastore ``path``; DatastoreError when missing or unreadable."""
    mpath = manifest_path(path)
    rebuild = "rebuild it with `vllm-accel datastore build --model MODEL --corpus ... --out PATH`"
    if not Path(path).is_file():
        raise DatastoreError(f"{KNOB}={str(path)!r}: no such file; {rebuild}, or unset the knob")
    if not mpath.is_file():
        raise DatastoreError(f"{KNOB}={str(path)!r}: its manifest {mpath.name} is missing; "
                             f"{rebuild}")
    try:
        manifest = json.loads(mpath.read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}")
        manifest["tokenizer"] = TokenizerIdentity(**manifest["tokenizer"])
        manifest["automaton"]["bytes"], manifest["automaton"]["sha256"]  # noqa: B018
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DatastoreError(f"{KNOB}={str(path)!r}: unreadable manifest {mpath.name} ({exc}); "
                             f"{rebuild}") from None
    return manifest


def load(path: str | os.PathLike, expected: TokenizerIdentity | None) -> SuffixAutomaton:
    """Load datastore ``path`` (frozen), checking it against its manifest and, when
    ``expected`` is given, that it was built with that tokenizer."""
    path = Path(path).expanduser()
    manifest = read_manifest(path)
    rebuild = "rebuild it with `vllm-accel datastore build --model MODEL --corpus ... --out PATH`"
    built_for: TokenizerIdentity = manifest["tokenizer"]
    if expected is not None and not built_for.matches(expected):
        raise DatastoreError(
            f"{KNOB}={str(path)!r} was built for tokenizer {built_for.name!r} (vocab "
            f"{built_for.vocab_size}, sha256 {built_for.sha256[:12]}), but this model's "
            f"tokenizer {expected.name!r} differs (vocab {expected.vocab_size}, sha256 "
            f"{expected.sha256[:12]}); rebuild it with `vllm-accel datastore build --model "
            f"{expected.name} --corpus ... --out PATH`")
    auto = manifest["automaton"]
    size = path.stat().st_size
    if size != auto["bytes"] or _file_sha256(path) != auto["sha256"]:
        raise DatastoreError(f"{KNOB}={str(path)!r} does not match its manifest (corrupt or "
                             f"replaced file); {rebuild}")
    try:
        return SuffixAutomaton.load(path)
    except (SAMFormatError, OSError) as exc:
        raise DatastoreError(f"{KNOB}={str(path)!r}: cannot load ({exc}); {rebuild}") from None
