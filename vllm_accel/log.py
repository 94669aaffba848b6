"""Loggers for vllm_accel.

They live under vLLM's ``vllm`` logger namespace (``vllm.accel.<name>``) so that our messages
come out with vLLM's format, honour ``VLLM_LOGGING_LEVEL``, and appear in the same stream as the
engine's own, in every process. Importing this module does not import vLLM.
"""

import logging


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"vllm.accel.{name}")
