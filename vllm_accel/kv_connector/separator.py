"""Resolve the ``chunk_separator`` knob to one token id of the served model's tokenizer."""

from __future__ import annotations

from typing import Any

from vllm_accel.kv_connector.config import AUTO_SEPARATORS, knob


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when the tokenizer keeps it as exactly one token, else ``None``."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - any tokenizer failure means "not usable"
        return None
    return ids[0] if len(ids) == 1 else None


def separator_from_tokenizer(tokenizer: Any, setting: str) -> int:
    candidates = AUTO_SEPARATORS if setting == "auto" else (setting,)
    for text in candidates:
        token_id = single_token_id(tokenizer, text)
        if token_id is not None:
            return token_id
    if setting == "auto":
        raise ValueError(
            f"{knob('chunk_separator')}=auto: this tokenizer has none of "
            f"{', '.join(AUTO_SEPARATORS)} as a single token; set chunk_separator to a special "
            f"token of this model (one token, never produced by ordinary text)")
    raise ValueError(f"{knob('chunk_separator')}={setting!r}: not a single token of this "
                     f"model's tokenizer; pick a special token (e.g. one of "
                     f"{', '.join(AUTO_SEPARATORS)} where the model has it)")


def resolve_separator(model_config: Any, setting: str) -> int:
    from vllm.tokenizers import cached_tokenizer_from_config

    return separator_from_tokenizer(cached_tokenizer_from_config(model_config), setting)
