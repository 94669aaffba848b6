"""Per-step and per-process accounting of ``ACCEL_SPARSE_PREFILL``: time and density.

Every layer's ``forward`` adds what it did to the step's :class:`StepStats` (one object per
metadata build, shared by the layers of a KV-cache group). When the last layer of the group has
reported, the step is closed: it is added to the per-process :data:`TOTALS`, logged (the first
sparse step of a process at INFO, every step at DEBUG) and, if the ``stats_path`` knob is set,
appended to that file as one JSON line — the way ``vllm-accel bench sparse-prefill`` reads the
attention time of the worker process from outside it.

Times are wall-clock seconds around the attention kernels of the layer (the CPU kernels are
synchronous): ``dense_s`` in vLLM's CPU attention kernel, ``score_s`` in block scoring and
selection, ``sparse_s`` in the block-sparse kernel; ``attention_s`` is their sum. ``density``
is selected / causal key blocks over the sparse layers and requests of the step.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field

from vllm_accel.log import get_logger

logger = get_logger("sparse_prefill")

_lock = threading.Lock()


@dataclass
class StepStats:
    num_layers: int  # layers of the KV-cache group: the step closes after this many reports
    sparse_requests: int = 0
    sparse_tokens: int = 0  # new tokens of the sparse requests
    sparse_context_tokens: int = 0  # tokens already in the cache before them (chunks, hits)
    sparse_max_seq_len: int = 0
    dense_prefill_tokens: int = 0
    decode_tokens: int = 0
    layers_reported: int = 0
    sparse_layers: int = 0
    dense_s: float = 0.0
    score_s: float = 0.0
    sparse_s: float = 0.0
    selected_blocks: float = 0.0
    causal_blocks: float = 0.0
    layer_density: dict[int, float] = field(default_factory=dict)
    closed: bool = False

    @property
    def attention_s(self) -> float:
        return self.dense_s + self.score_s + self.sparse_s

    @property
    def density(self) -> float | None:
        return self.selected_blocks / self.causal_blocks if self.causal_blocks else None

    def add_dense(self, seconds: float) -> None:
        self.dense_s += seconds

    def add_sparse(self, layer: int | None, score_s: float, sparse_s: float, selected: float,
                   causal: float) -> None:
        if layer is not None and causal:
            self.layer_density[layer] = selected / causal
        self.score_s += score_s
        self.sparse_s += sparse_s
        self.selected_blocks += selected
        self.causal_blocks += causal
        self.sparse_layers += 1

    def layer_done(self, stats_path: str | None) -> None:
        self.layers_reported += 1
        if self.layers_reported >= self.num_layers and not self.closed:
            self.closed = True
            TOTALS.add(self)
            _report(self, stats_path)

    def record(self) -> dict:
        rec = {k: v for k, v in asdict(self).items() if k not in ("closed",)}
        rec.update(attention_s=self.attention_s, density=self.density, time=time.time(),
                   pid=os.getpid())
        return rec


@dataclass
class ProcessTotals:
    """Everything this process's steps did (for logs, tests and the doctor)."""

    steps: int = 0
    sparse_steps: int = 0
    sparse_tokens: int = 0
    dense_s: float = 0.0
    score_s: float = 0.0
    sparse_s: float = 0.0
    selected_blocks: float = 0.0
    causal_blocks: float = 0.0

    def add(self, step: StepStats) -> None:
        with _lock:
            self.steps += 1
            self.sparse_steps += step.sparse_layers > 0
            self.sparse_tokens += step.sparse_tokens if step.sparse_layers else 0
            self.dense_s += step.dense_s
            self.score_s += step.score_s
            self.sparse_s += step.sparse_s
            self.selected_blocks += step.selected_blocks
            self.causal_blocks += step.causal_blocks

    @property
    def density(self) -> float | None:
        return self.selected_blocks / self.causal_blocks if self.causal_blocks else None


TOTALS = ProcessTotals()
_first_sparse_logged = {"done": False}


def _report(step: StepStats, stats_path: str | None) -> None:
    if step.sparse_layers:
        msg = ("ACCEL_SPARSE_PREFILL step: %d sparse request(s), %d sparse tokens (seq up to %d) "
               "in %d layer(s), density %.3f; attention %.3f s (score %.3f, sparse %.3f, "
               "dense %.3f); %d dense prefill + %d decode tokens")
        args = (step.sparse_requests, step.sparse_tokens, step.sparse_max_seq_len,
                step.sparse_layers, step.density or 0.0, step.attention_s, step.score_s,
                step.sparse_s, step.dense_s, step.dense_prefill_tokens, step.decode_tokens)
        if not _first_sparse_logged["done"]:
            _first_sparse_logged["done"] = True
            logger.info("first sparse prefill of this process. " + msg, *args)
        else:
            logger.debug(msg, *args)
    if stats_path and step.sparse_tokens + step.dense_prefill_tokens > 0:
        line = json.dumps(step.record())
        with _lock, open(stats_path, "a") as f:
            f.write(line + "\n")
