"""A proposer failure never fails a request: the step gets no drafts (the target model decodes
as without speculation), the failure is counted (``vllm:accel_proposer_errors_total``) and
logged once per proposer and kind, with its traceback. No vLLM import."""

from __future__ import annotations

from collections.abc import Callable

from vllm_accel import faults
from vllm_accel.log import get_logger

logger = get_logger("spec_decode")


class LogOnce:
    """Logs each ``key`` the first time only (later occurrences are silent)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def warning(self, key: str, message: str) -> None:
        if key not in self._seen:
            self._seen.add(key)
            logger.warning(message)

    def error(self, key: str, message: str) -> None:
        """An ERROR with the current exception's traceback (call it in an ``except`` block)."""
        if key not in self._seen:
            self._seen.add(key)
            logger.error(message, exc_info=True)


def drafts_or_none(who: str, once: LogOnce, num_rows: int,
                   propose: Callable[[], list[list[int]]],
                   on_error: Callable[[], None] | None = None) -> list[list[int]]:
    """``propose()``, or ``num_rows`` empty drafts when it raises (counted, logged once;
    ``on_error`` drops state the failure may have left half-updated)."""
    try:
        return propose()
    except Exception:
        faults.record("proposer_errors")
        once.error("propose", f"{who} failed; this step gets no drafts (outputs are "
                              f"unaffected). Logged once; later failures are silent.")
        if on_error is not None:
            on_error()
        return [[] for _ in range(num_rows)]


def drafts_without_batch(who: str, once: LogOnce, num_rows: int) -> list[list[int]]:
    """No drafts for vLLM's plain ``custom_class`` call, which lacks the request ids a
    per-request proposer needs (warned once)."""
    once.warning("unpatched", f"{who} was called without the input batch (the "
                              "proposer_input_batch runtime patch is not active in this "
                              "process), so it drafts nothing; check the log for why the patch "
                              "was not applied")
    return [[] for _ in range(num_rows)]
