"""`KvstoreConnector`: vLLM's KV connector (KVConnectorBase_V1, with SupportsHMA) over kvstore.

Loaded out of tree:

    KVTransferConfig(kv_connector="KvstoreConnector",
                     kv_connector_module_path="kvstore.integrations.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"address": "host:port", "token": "..."})

vLLM builds one connector per role: the scheduler's (`SchedulerSide`) and each worker's
(`WorkerSide`). Both derive the same layout from vLLM's KV cache config and the same model
identity (the weights' fingerprint, or `revision`), and register it with kvstore on first use.
Each request's `kv_transfer_params` in its output carries what the connector did for it and the
connector's counters (failures by kind, chunks stored and loaded).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.platforms import current_platform

from kvstore.integrations.vllm.cache_layout import EnginePlan, plan_from_vllm
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.identity import fingerprint, local_files
from kvstore.integrations.vllm.link import Link
from kvstore.integrations.vllm.metadata import KvstoreMeta, WorkerHandshake, WorkerReport
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.worker import WorkerSide
from kvstore.layout import MAX_ENGINE_NAME

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput

log = logging.getLogger("kvstore.integrations.vllm")
# Of a configured revision hashed down to fit the service's bound, the characters kept as given.
REVISION_KEPT_CHARS = 48
# Of a default model name (the model's directory or file name) that the service would refuse, the
# characters kept for people, and the hex digits of the whole name's hash after them (within 128).
NAME_KEPT_CHARS = 96
NAME_HASH_HEX = 24


def model_identity(model_config: Any, cfg: ConnectorConfig) -> tuple[str, str]:
    """(name, revision): the configured revision, else the fingerprint of the weight files (a
    model directory's, or a single GGUF file's), with what vLLM changes at load mixed in."""
    path = Path(str(model_config.model))
    # A configured name is checked at start (ConnectorConfig); a derived one is made valid.
    name = cfg.model_name or default_model_name(path.name or str(model_config.model))
    revision = cfg.revision
    if not revision:
        local = local_files(str(model_config.model), getattr(model_config, "revision", None))
        if local is None:
            raise ValueError(f"the model {model_config.model} is neither a path nor in the local Hugging Face cache: "
                             "the kvstore connector cannot fingerprint its weights (set its 'revision')")
        revision = fingerprint(local, cfg.fingerprint_cache)
    suffix = f"+{load_options(model_config)}"
    if len(revision) + len(suffix) > MAX_ENGINE_NAME:
        # A configured revision too long to fit beside the suffix in the service's bound: its
        # start kept for people, the whole of it hashed (else every registration would fail).
        revision = f"{revision[:REVISION_KEPT_CHARS]}~{hashlib.sha256(revision.encode()).hexdigest()[:32]}"
    return name, revision + suffix


def default_model_name(given: str) -> str:
    """`given` (the model's directory or file name) as a name the service takes, 1 to
    MAX_ENGINE_NAME printable characters; else every RegisterModel failed and the engine ran with
    caching off. One it would refuse (too long, unprintable characters, empty) keeps its start, its
    unprintable characters replaced, and a hash of the whole of it, so two such names stay apart."""
    if given and len(given) <= MAX_ENGINE_NAME and given.isprintable():
        return given
    start = "".join(c if c.isprintable() else "_" for c in given[:NAME_KEPT_CHARS]) or "model"
    return f"{start}~{hashlib.sha256(given.encode('utf-8', 'surrogatepass')).hexdigest()[:NAME_HASH_HEX]}"


def load_options(model_config: Any) -> str:
    """What vLLM does to the weights as it loads them (quantization, dtype, config overrides such
    as rope_theta), hashed: the same files loaded otherwise compute other KV."""
    overrides = getattr(model_config, "hf_overrides", None) or {}
    if callable(overrides):  # a function that edits the config: named, its body cannot be compared
        overrides = f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', repr(overrides))}"
    options = {"quantization": str(getattr(model_config, "quantization", None) or ""),
               "dtype": str(getattr(model_config, "dtype", "")).removeprefix("torch."),
               "hf_overrides": overrides}
    return hashlib.sha256(json.dumps(options, sort_keys=True, default=repr).encode()).hexdigest()[:12]


def with_cpu_isas(plan: EnginePlan, vllm_config: Any) -> EnginePlan:
    """`plan` with each K/V group's CPU kernel ISA, picked as vLLM's CPU attention backend picks it
    (by dtype, block size, head size, cache dtype and this machine's CPU): it decides how a block
    lies. Both roles register the layout, so both ask (the scheduler has no attention layers)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype, cache_dtype = vllm_config.model_config.dtype, vllm_config.cache_config.cache_dtype
    return dataclasses.replace(plan, groups=tuple(
        g if g.latent else dataclasses.replace(g, cpu_isa=_get_attn_isa(dtype, plan.block_tokens, g.head_size,
                                                                        cache_dtype))
        for g in plan.groups))


def tensor_rank(role: KVConnectorRole) -> int:
    """This worker's tensor-parallel rank; the scheduler's connector speaks for rank 0."""
    if role != KVConnectorRole.WORKER:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def attention_backends(vllm_config: Any, layer_names: Iterable[str]) -> dict[str, str]:
    """Each layer's attention backend by vLLM's name: it decides how a block tensor holds K and V."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(layer_names))
    return {name: layer.get_attn_backend().get_name() for name, layer in layers.items()}


class KvstoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        pc = vllm_config.parallel_config
        context = {name: getattr(pc, name, 1) or 1 for name in ("decode_context_parallel_size",
                                                                 "prefill_context_parallel_size")}
        if pc.pipeline_parallel_size > 1 or any(n > 1 for n in context.values()):
            # A pipeline stage holds some of the layers, and a layout names them all; with context
            # parallelism a rank's blocks hold some of the tokens, and a chunk is all of them.
            raise ValueError(f"the kvstore connector does not yet support pipeline or context parallelism "
                             f"(pipeline_parallel_size={pc.pipeline_parallel_size}, "
                             + ", ".join(f"{k}={v}" for k, v in context.items()) + "); tensor parallelism it does")
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kvstore: kv_load_failure_policy is %r: a chunk that cannot be loaded (corrupt, evicted, "
                        "kvstore down) fails its request instead of being computed; set it to 'recompute'",
                        self._kv_transfer_config.kv_load_failure_policy)
        cfg = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        plan = plan_from_vllm(kv_cache_config, vllm_config.cache_config.block_size, cfg.chunk_tokens)
        if current_platform.device_type == "cpu":
            plan = with_cpu_isas(plan, vllm_config)
        if pc.tensor_parallel_size > 1:
            # Each rank's cache holds its share of the KV heads: stored and loaded under a layout of
            # its own. The scheduler asks about rank 0's (a rank that misses loads nothing and has
            # vLLM compute those blocks again).
            plan = dataclasses.replace(plan, shard=f"tp{tensor_rank(role)}of{pc.tensor_parallel_size}")
        mc = vllm_config.model_config
        name, revision = model_identity(mc, cfg)
        link = Link(cfg, plan.engine_model(name, revision, mc.get_vocab_size(), 0.0))
        self._scheduler = SchedulerSide(link, plan) if role == KVConnectorRole.SCHEDULER else None
        self._worker = WorkerSide(link, plan) if role == KVConnectorRole.WORKER else None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that never happens is only a later miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # saves copy each layer in Python: a step replayed as one full CUDA graph would skip them

    # --- worker side ------------------------------------------------------------------------------

    def _w(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    def _meta(self) -> KvstoreMeta:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvstoreMeta)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register(kv_caches, current_platform.device_type, attention_backends(self._vllm_config, kv_caches))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._w().start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its load has finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._w().save_layer(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        self._w().submit_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._w().transfer_results()[0] or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        done, failed = self._w().transfer_results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().take_load_errors()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return self._w().report()

    def get_handshake_metadata(self) -> WorkerHandshake | None:
        # vLLM asks each worker once, after its KV caches are registered, and hands the answers
        # to the scheduler's connector (set_xfer_handshake_metadata) before the first request.
        return self._w().handshake()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # --- scheduler side ---------------------------------------------------------------------------

    def _s(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker's connector"
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._s().after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        manager = self._kv_cache_manager
        assert manager is not None, "vLLM binds its KV cache manager before scheduling"
        return self._s().build_meta(scheduler_output, manager.get_block_ids, manager.block_pool.null_block.block_id)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._s().worker_sessions(tuple(m.shm_session if isinstance(m, WorkerHandshake) else ""
                                        for _, m in sorted(metadata.items())))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, WorkerReport):
            self._s().worker_report(meta.counters, meta.shm_sessions, meta.failed_loads, meta.dropped_saves,
                                    meta.not_cached, meta.failed_steps, meta.failed_load_chunks)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self._s().finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, self._s().finished(request)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # A load restores every group: the full-attention chunks and, for a hybrid model, the
        # sliding-window blocks at the boundary (no hit is reported without them).
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))
