"""``ChunkReuseConnector``: position-independent chunk reuse through vLLM's KV-connector API.

Scheduler side (EngineCore): finds each prompt's chunks (:mod:`.chunking`), keys them
(:mod:`.identity`), asks the store which it has, and claims ``[local hit, claim_end)`` as external
tokens with a synchronous load (:mod:`.planner`). Blocks from the first approximate token on are
re-hashed off vLLM's exact prefix-hash chain, so blended KV is never served as an exact prefix
hit. Each step it ships the loads, recompute rows and saves to the workers.

Worker side, before the forward (vLLM runs ``start_load_kv`` first when a sync load exists):
writes each stored chunk's V and RoPE-re-rotated K (``kernels.rope_rerotate``) into the
request's pages, then recomputes the chosen tokens (:mod:`.blend`). A chunk that cannot be
loaded (evicted, corrupt, store down) is recomputed there instead: a store fault costs time,
never a failed request or wrong KV. After the forward (``wait_for_save``) chunks seen for the
first time are copied out of the pages into the store.

The connector implements ``SupportsHMA`` so vLLM keeps its hybrid allocator on.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from vllm_accel import faults
from vllm_accel.kv_connector import ape, blend
from vllm_accel.kv_connector.chunking import ChunkMarkupError, find_chunks
from vllm_accel.kv_connector.config import (
    ChunkReuseConfig,
    ChunkReuseConfigError,
    knob,
    parse_config,
)
from vllm_accel.kv_connector.identity import chunk_key, fingerprint_from_vllm
from vllm_accel.kv_connector.metrics import (
    ChunkReusePromMetrics,
    ChunkReuseStats,
    ReuseCounters,
)
from vllm_accel.kv_connector.paged_kv import PagedLayerKV
from vllm_accel.kv_connector.planner import (
    ChunkLoad,
    PlannedChunk,
    ReusePlan,
    approx_start,
    chunks_to_save,
    plan_reuse,
    windows_by_rank,
)
from vllm_accel.kv_connector.separator import resolve_separator
from vllm_accel.kv_connector.stores import shared_store
from vllm_accel.kv_connector.stores.base import ChunkKV
from vllm_accel.log import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = get_logger("kv_connector")
NAME = "ChunkReuseConnector"
_MAX_KNOWN_KEYS = 1 << 20
UNQUANTIZED_KV_DTYPES = ("auto", "float16", "bfloat16", "float32")


@dataclass
class RequestLoad:
    req_id: str
    block_ids: list[int]
    token_ids: list[int]  # prompt tokens [0, claim_end)
    loads: list[ChunkLoad]
    forced: list[int]
    epic: list[int]
    candidates: list[int]
    #: ``recompute=query`` only: the prompt tokens after the claim (they probe the pages) and
    #: where the question starts (the end of the last chunk).
    suffix_ids: list[int] = field(default_factory=list)
    question_start: int = 0


@dataclass
class ChunkSave:
    req_id: str
    key: str
    start: int
    end: int
    block_ids: list[int]


@dataclass
class ChunkReuseMetadata(KVConnectorMetadata):
    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)


@dataclass
class ChunkIndexUpdate(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: chunk keys saved, and keys found missing at load."""
    saved: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ChunkIndexUpdate)
        return ChunkIndexUpdate(self.saved & other.saved, self.lost | other.lost)


@dataclass
class _RequestState:
    request: Any
    chunks: list[PlannedChunk]
    plan: ReusePlan | None = None
    load_pending: bool = False
    saved: set[str] = field(default_factory=set)
    retagged_from: int | None = None


def retag_block_hashes(request: Any, start_token: int, hash_block_size: int) -> None:
    """Move the request's block hashes from the block holding ``start_token`` on off vLLM's
    exact chain: blended KV is cached under these tags and never matches an exact lookup."""
    for i in range(start_token // hash_block_size, len(request.block_hashes)):
        tagged = hashlib.sha256(b"vllm_accel:chunk-reuse:approx:" + bytes(request.block_hashes[i]))
        request.block_hashes[i] = type(request.block_hashes[i])(tagged.digest())


class ChunkReuseConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        try:
            self.config: ChunkReuseConfig = parse_config(extra)
        except ChunkReuseConfigError as exc:
            raise ValueError(str(exc)) from None
        self.block_size = vllm_config.cache_config.block_size
        self.fingerprint = fingerprint_from_vllm(vllm_config.model_config,
                                                 vllm_config.cache_config)
        try:
            self.store = shared_store(list(self.config.stores), self.config.memory_bytes)
        except ValueError as exc:  # a bad store spec fails at start-up, naming the knob
            raise ValueError(f"{knob('stores')}: {exc}") from None
        self.counters = ReuseCounters(role.name.lower(), self.config.log_interval_s)
        self._requests: dict[str, _RequestState] = {}
        self._layers: dict[str, PagedLayerKV] | None = None  # by name, in layer order
        self._ape: ape.ApeRegistry | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        # Scheduler: chunk keys the workers saved (their memory tier is in their process).
        self._known: OrderedDict[str, None] = OrderedDict()
        # Worker: what to tell the scheduler after this step.
        self._index_update = ChunkIndexUpdate()
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype not in UNQUANTIZED_KV_DTYPES:
            raise ValueError(f"{NAME} stores and writes unquantized KV; --kv-cache-dtype "
                             f"{cache_dtype} is not supported with it yet (use one of "
                             f"{', '.join(UNQUANTIZED_KV_DTYPES)})")
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            raise ValueError(f"{NAME} does not support --tensor-parallel-size > 1 yet (chunk "
                             f"KV is stored per worker); use one GPU per engine")
        if role == KVConnectorRole.SCHEDULER:
            self.separator_id = resolve_separator(vllm_config.model_config,
                                                  self.config.chunk_separator)
        logger.info("%s (%s): stores %s, recompute=%s, attention temperature/scale %s/%s, "
                    "fingerprint %s", NAME, role.name, list(self.config.stores),
                    self.config.recompute, self.config.attention_temperature,
                    self.config.attention_scale, self.fingerprint[:12])

    @classmethod
    def validate_kv_transfer_params(cls, vllm_config: VllmConfig,
                                    prompt_token_ids: list[int] | None,
                                    kv_transfer_params: Any) -> None:
        """Request front end (``kv_transfer_params_validation`` patch): malformed chunk params
        are the client's fault, refused with a 400 before the request is scheduled. Raises
        :class:`~.chunking.ChunkMarkupError` (a ``ValueError``)."""
        if kv_transfer_params is not None:
            find_chunks(prompt_token_ids or [], None, kv_transfer_params)

    # ------------------------------------------------------------------ scheduler side

    def _state(self, request: Request) -> _RequestState | None:
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        try:
            spans = find_chunks(request.prompt_token_ids or [], self.separator_id,
                                request.kv_transfer_params)
        except ChunkMarkupError as exc:
            self.counters.add("markup_errors")
            logger.warning("%s: request %s: %s; serving it without chunk reuse", NAME,
                           request.request_id, exc)
            spans = []
        if not spans:
            return None
        tokens = request.prompt_token_ids
        chunks = [PlannedChunk(s, chunk_key(self.fingerprint, request.cache_salt,
                                            tokens[s.start:s.end]), False) for s in spans]
        state = _RequestState(request, chunks)
        self._requests[request.request_id] = state
        self.counters.add("requests_with_chunks")
        return state

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if state is None:
            return 0, False
        state.chunks = [PlannedChunk(c.span, c.key, self._stored(c.key)) for c in state.chunks]
        plan = plan_reuse(state.chunks, request.num_prompt_tokens, num_computed_tokens,
                          self.block_size, self.config.min_reuse_tokens,
                          self.config.epic_tokens)
        if plan.num_external > 0 and not self._retag(state, plan):
            plan = ReusePlan(state.chunks, local=num_computed_tokens,
                             claim_end=num_computed_tokens)  # no reuse
        state.plan = plan
        return plan.num_external, False

    def _retag(self, state: _RequestState, plan: ReusePlan) -> bool:
        start = approx_start(plan)
        if start is None or state.retagged_from is not None:
            return True
        request = state.request
        if len(request.block_hashes) != request.num_tokens // self.block_size:
            logger.warning("%s: request %s: block hashes are not per %d-token block; not "
                           "reusing chunks (blended KV could be served as exact)", NAME,
                           request.request_id, self.block_size)
            return False
        retag_block_hashes(request, start, self.block_size)
        state.retagged_from = start
        return True

    def _stored(self, key: str) -> bool:
        if key in self._known:
            self._known.move_to_end(key)
            return True
        return self.store.contains(key)

    def update_connector_output(self, connector_output: Any) -> None:
        update = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(update, ChunkIndexUpdate):
            return
        for key in update.saved:
            self._known[key] = None
        for key in update.lost:
            self._known.pop(key, None)
        while len(self._known) > _MAX_KNOWN_KEYS:
            self._known.popitem(last=False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or state.plan is None or num_external_tokens == 0:
            return
        state.load_pending = num_external_tokens == state.plan.num_external

    def _block_ids(self, req_id: str) -> list[int]:
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = ChunkReuseMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, state in self._requests.items():
            if req_id not in scheduled:
                continue
            plan, request = state.plan, state.request
            if state.load_pending and plan is not None:
                state.load_pending = False
                load = RequestLoad(req_id, self._block_ids(req_id),
                                   list(request.prompt_token_ids[:plan.claim_end]), plan.loads,
                                   plan.forced, plan.epic, plan.candidates)
                if self.config.recompute == "query":
                    load.suffix_ids = list(request.prompt_token_ids[plan.claim_end:])
                    load.question_start = max(c.span.end for c in plan.chunks)
                meta.loads.append(load)
                self.counters.add("reused_requests")
                self.counters.add("claimed_tokens", plan.num_external)
                self.counters.add("hit_tokens", plan.loaded_tokens)
                self.counters.add("miss_tokens", len(plan.forced))
            if not self.config.save_new_chunks:
                continue
            computed_after = request.num_computed_tokens + scheduled[req_id]
            for chunk in chunks_to_save(state.chunks, state.saved, computed_after):
                state.saved.add(chunk.key)
                meta.saves.append(ChunkSave(req_id, chunk.key, chunk.span.start, chunk.span.end,
                                            self._block_ids(req_id)))
        return meta

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        self._requests.pop(request.request_id, None)
        self.counters.maybe_log(self.store)
        return False, None

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        if self.config.ape:
            self._install_ape()

    def _install_ape(self) -> None:
        context = self._vllm_config.compilation_config.static_forward_context
        registry = ape.ApeRegistry(self.config.attention_temperature,
                                   self.config.attention_scale)
        try:
            count = ape.install({n: context[n] for n in self._kv_caches}, registry,
                                lambda name: self._paged_by_name()[name])
        except ValueError as exc:
            raise ValueError(f"{knob('attention_temperature')}/{knob('attention_scale')}: APE "
                             f"attention cannot run on this model: {exc}") from None
        self._ape = registry
        logger.info("%s: APE attention on %d layers (temperature %s, scale %s)", NAME, count,
                    registry.temperature, registry.chunk_scale)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        if self._ape is not None:
            self._ape.drop(finished_req_ids)
            token_layers = self._ape.take_token_layers()
            if token_layers:
                self.counters.add("ape_token_layers", token_layers)
                self.counters.maybe_log(self.store)
        return None, None

    def _paged_layers(self) -> list[PagedLayerKV]:
        return list(self._paged_by_name().values())

    def _paged_by_name(self) -> dict[str, PagedLayerKV]:
        """K/V views of every layer's pages, in layer order (made at first use: on CPU the
        page layout follows the ISA the attention builder sets on each layer)."""
        if self._layers is None:
            from vllm.model_executor.models.utils import extract_layer_index
            from vllm.platforms import current_platform

            context = self._vllm_config.compilation_config.static_forward_context
            names = sorted(self._kv_caches, key=extract_layer_index)
            cpu = current_platform.is_cpu()
            self._layers = {
                n: PagedLayerKV(self._kv_caches[n], self.block_size,
                                getattr(context.get(n), "isa", "vec") if cpu else None)
                for n in names}
        return self._layers

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ChunkReuseMetadata) or not meta.loads:
            return
        model = blend.registered_model()
        if model is None:
            raise RuntimeError(f"{NAME}: the model did not register with the connector; the "
                               f"architecture is not supported for chunk reuse")
        for load in meta.loads:
            self._load_request(model, load)
        # steps that only load save nothing: without this, a run of reused requests would not
        # log its counters until shutdown
        self.counters.maybe_log(self.store)

    def _load_request(self, model: torch.nn.Module, req: RequestLoad) -> None:
        from vllm_accel.kernels.rope_rerotate import rerotate_keys

        started = time.perf_counter()
        layers = self._paged_layers()
        device = layers[0].k.device
        block_table = torch.tensor(req.block_ids, dtype=torch.long, device=device)
        rotary = blend.rotary_of(model)
        forced = list(req.forced)
        failed: set[int] = set()
        for load in req.loads:
            chunk = self.store.get(load.key, self.fingerprint)
            if not _fits(chunk, load, len(layers), layers[0]):
                self.counters.add("load_failures")
                self._index_update.lost.add(load.key)
                failed.update(range(load.position, load.position + load.count))
                continue
            positions = torch.arange(load.position, load.position + load.count, device=device)
            part = slice(load.offset, load.offset + load.count)
            keys = chunk.keys[:, part].to(device)
            num_layers, n, heads, dim = keys.shape
            keys = rerotate_keys(keys.reshape(num_layers * n, heads, dim),
                                 load.chunk_start - chunk.start_position,
                                 rotary.cos_sin_cache, rotary.rotary_dim,
                                 rotary.is_neox_style).view(num_layers, n, heads, dim)
            values = chunk.values[:, part].to(device)
            for layer, paged in enumerate(layers):
                paged.write(block_table, positions, keys[layer], values[layer])
            self.counters.add("loaded_bytes", keys.nbytes + values.nbytes)
            self.counters.add("loaded_tokens", load.count)
        forced += sorted(failed)
        self.counters.add("forced_tokens", len(forced))
        loaded = [p for p in req.candidates if p not in failed]  # loaded approximate tokens
        self._recompute(model, layers, block_table, req, forced, loaded)
        if self._ape is not None:
            self._ape.record(req.req_id, loaded, len(req.token_ids))
        self.counters.add("load_seconds", time.perf_counter() - started)

    def _recompute(self, model: torch.nn.Module, layers: list[PagedLayerKV],
                   block_table: torch.Tensor, req: RequestLoad, forced: list[int],
                   loaded: list[int]) -> None:
        policy, device = self.config.recompute, block_table.device
        candidates: torch.Tensor | None = None
        if policy == "cacheblend":
            rows = sorted(set(forced) | set(loaded))
            chosen = set(loaded)
            candidates = torch.tensor([p in chosen for p in rows], dtype=torch.bool,
                                      device=device)
        elif policy == "query":
            rows = sorted(set(forced) | set(self._query_choice(model, layers, block_table, req,
                                                               forced, loaded)))
        elif policy == "epic":
            rows = sorted(set(forced) | set(req.epic))
        else:
            rows = sorted(set(forced))
        if not rows:
            return
        positions = torch.tensor(rows, dtype=torch.long, device=device)
        token_ids = torch.tensor([req.token_ids[p] for p in rows], dtype=torch.long,
                                 device=device)
        result = blend.recompute_tokens(model, layers, block_table, token_ids, positions,
                                        candidates, self.config.recompute_ratio)
        self.counters.add("recompute_token_layers", result.token_layers)
        self.counters.add("claimed_token_layers", (len(req.token_ids) - _first_claimed(req))
                          * len(layers))

    def _query_choice(self, model: torch.nn.Module, layers: list[PagedLayerKV],
                      block_table: torch.Tensor, req: RequestLoad, forced: list[int],
                      loaded: list[int]) -> list[int]:
        """``recompute=query``: the ``loaded`` approximate tokens that the question's
        upper-layer heads read most sharply, with their ``query_window`` neighbours, up to
        ``recompute_ratio`` of them. The probe runs before anything is recomputed; the
        positions still to compute (``forced``) are masked out of it."""
        budget = math.ceil(self.config.recompute_ratio * len(loaded))
        if budget == 0 or not req.suffix_ids:
            return []
        device = block_table.device
        key_valid = torch.ones(len(req.token_ids), dtype=torch.bool, device=device)
        if forced:
            key_valid[torch.tensor(forced, dtype=torch.long, device=device)] = False
        peaks, token_layers = blend.question_attention_peaks(
            model, layers, block_table,
            torch.tensor(req.suffix_ids, dtype=torch.long, device=device), key_valid,
            req.question_start, first_scored_layer=len(layers) // 2,
            draft_tokens=self.config.query_draft_tokens)
        self.counters.add("recompute_token_layers", token_layers)
        positions = torch.tensor(loaded, dtype=torch.long, device=device)
        ranked = positions[torch.argsort(peaks[positions], descending=True)].tolist()
        return windows_by_rank(ranked, set(loaded), budget, self.config.query_window)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ChunkReuseMetadata) or not meta.saves:
            return
        layers = self._paged_layers()
        device = layers[0].k.device
        for save in meta.saves:
            block_table = torch.tensor(save.block_ids, dtype=torch.long, device=device)
            positions = torch.arange(save.start, save.end, device=device)
            pairs = [paged.read(block_table, positions) for paged in layers]
            chunk = ChunkKV(keys=torch.stack([k for k, _ in pairs]).cpu(),
                            values=torch.stack([v for _, v in pairs]).cpu(),
                            start_position=save.start, fingerprint=self.fingerprint)
            self.store.put(save.key, chunk)
            if self.store.contains(save.key):  # tell the scheduler only what a load can find
                self._index_update.saved.add(save.key)
            self.counters.add("saved_chunks")
            self.counters.add("saved_bytes", chunk.nbytes())
        self.counters.maybe_log(self.store)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        update, self._index_update = self._index_update, ChunkIndexUpdate()
        return update if (update.saved or update.lost) else None

    def get_kv_connector_stats(self) -> ChunkReuseStats | None:
        # faults of other features in this worker (vllm_accel.faults) ride the same channel
        increments = self.counters.take_increments(self.store) | faults.take_increments()
        return ChunkReuseStats(increments) if increments else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> ChunkReuseStats | None:
        return ChunkReuseStats(dict(data)) if data is not None else ChunkReuseStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> ChunkReusePromMetrics:
        return ChunkReusePromMetrics(vllm_config, metric_types, labelnames,
                                     per_engine_labelvalues)

    def shutdown(self) -> None:
        self.counters.maybe_log(self.store, force=True)


def _first_claimed(req: RequestLoad) -> int:
    starts = [load.position for load in req.loads] + req.forced
    return min(starts) if starts else len(req.token_ids)


def _fits(chunk: ChunkKV | None, load: ChunkLoad, num_layers: int, paged: PagedLayerKV) -> bool:
    """A stored chunk usable for ``load``: present, this model's shape, long enough."""
    if chunk is None:
        return False
    shape = chunk.keys.shape
    return (len(shape) == 4 and shape[0] == num_layers and shape[2:] == paged.k.shape[2:]
            and shape[1] >= load.offset + load.count and chunk.values.shape == shape)
