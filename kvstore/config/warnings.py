"""Settings that are each valid but contradict one another: said by `kvstore check-config` (and
logged by `kvstore serve`), never refused, since the service can run with them."""

from __future__ import annotations

import math

from kvstore.config import KvstoreConfig, least_total, tenants_without_a_share
from kvstore.config.local_pool import ENTRY_OVERHEAD_BYTES
from kvstore.config.service import is_loopback
from kvstore.errors import InvalidInput, UnknownModel
from kvstore.layout import MAX_ENGINE_MODELS, MAX_ENGINE_MODELS_PER_TENANT, get_model
from policies.fair_share import weighted_split


def config_warnings(cfg: KvstoreConfig) -> list[str]:
    """One sentence per contradiction, naming the keys."""
    out: list[str] = []
    ttl = cfg.local_pool.ttl
    lo, hi = ttl.min_ttl_seconds, ttl.max_ttl_seconds
    if not lo <= ttl.ttl_seconds <= hi:
        out.append(f"local_pool.ttl.ttl_seconds = {ttl.ttl_seconds:g} is outside [min_ttl_seconds, "
                   f"max_ttl_seconds] = [{lo:g}, {hi:g}]: the adaptive policy would clamp it, the fixed "
                   f"and sliding ones use it as is ({ttl.kind} is in force)")
    for tenant, v in sorted(ttl.tenant_ttl_seconds.items()):
        if not lo <= v <= hi:
            out.append(f"local_pool.ttl.tenant_ttl_seconds.{tenant} = {v:g} is outside [{lo:g}, {hi:g}] "
                       "(min_ttl_seconds, max_ttl_seconds)")
        if cfg.tenants and tenant not in cfg.tenants:
            out.append(f"local_pool.ttl.tenant_ttl_seconds.{tenant}: no tenant '{tenant}' in [tenants]")
    if cfg.replay.mode == "off" and cfg.replay.runner != "none":
        out.append(f"replay.runner = '{cfg.replay.runner}' has no effect with replay.mode = 'off'")
    if cfg.replay.timeout_seconds > ttl.ttl_seconds:
        out.append(f"replay.timeout_seconds = {cfg.replay.timeout_seconds:g} is longer than "
                   f"local_pool.ttl.ttl_seconds = {ttl.ttl_seconds:g}: a replay may outlive the snapshot it rebuilds")
    adm = cfg.admin
    if adm.per_tenant_labels and not adm.metrics_require_token and not is_loopback(adm.host):
        out.append(f"admin.per_tenant_labels = true with admin.metrics_require_token = false on admin.host = "
                   f"'{adm.host}' (not loopback): /metrics shows every tenant's name and traffic to anyone "
                   "who can reach the port")
    elif adm.per_tenant_labels and not adm.metrics_require_token and cfg.tenants:
        # A loopback bind keeps out other hosts, not this host's other users and processes: a
        # tenant's token, or none, reads every other tenant's labelled series.
        out.append(f"admin.per_tenant_labels = true with admin.metrics_require_token = false and [tenants] "
                   f"configured: /metrics on admin.host = '{adm.host}' shows every tenant's name and traffic to "
                   "any caller on this host, with no token (set admin.metrics_require_token = true and "
                   "admin.admin_token)")
    out += _zero_shares(cfg)
    out += _pool_below_a_snapshot(cfg)
    out += _tiers_below_a_chunk(cfg)
    out += _messages_clients_send(cfg)
    out += _engine_models_below_their_share(cfg)
    return out


def _engine_models_below_their_share(cfg: KvstoreConfig) -> list[str]:
    """More tenants than the total of registered models gives each its per-tenant figure: each
    then holds an equal share of the total, fewer (a tenant past it retires its unused models)."""
    n = len(cfg.tenants)
    share = max(1, MAX_ENGINE_MODELS // max(1, n))
    if share >= MAX_ENGINE_MODELS_PER_TENANT:
        return []
    return [f"[tenants] names {n} tenants: each may hold {share} engine-registered models (RegisterModel), an "
            f"equal share of the service's {MAX_ENGINE_MODELS}, not {MAX_ENGINE_MODELS_PER_TENANT}; a tenant holding "
            f"{share} that registers another (a new revision) retires its least recently used model that holds no "
            "chunks, and is refused where all of them hold chunks"]


# What kvstore's own clients put in one streamed message by default: KvstoreClient's `message_bytes`
# (client/sync_client.py), which the vLLM connector does not change, plus a piece's header (30 bytes
# for a Store's, 19 for a StoreLocal's, measured; 64 with room).
CLIENT_MESSAGE_BYTES = 1 << 20
PIECE_HEADER_BYTES = 64


def _messages_clients_send(cfg: KvstoreConfig) -> list[str]:
    """A message limit under what the project's clients send by default: their larger Stores and
    StoreLocals are refused (the service's own INVALID_ARGUMENT, or past twice the limit + 4 KiB,
    gRPC's RESOURCE_EXHAUSTED). Not refused: a client given a smaller `message_bytes` works."""
    limit = cfg.service.max_message_bytes
    least = CLIENT_MESSAGE_BYTES + PIECE_HEADER_BYTES
    if limit >= least:
        return []
    return [f"service.max_message_bytes = {limit} is less than the {least}-byte messages kvstore's clients send "
            f"by default (KvstoreClient's message_bytes, {CLIENT_MESSAGE_BYTES}, which the vLLM connector uses): their "
            f"Stores and StoreLocals of more than {limit - PIECE_HEADER_BYTES} bytes are refused; set it to at least "
            f"{least}, or give every KvstoreClient message_bytes <= {limit - PIECE_HEADER_BYTES}"]


def _tiers_below_a_chunk(cfg: KvstoreConfig) -> list[str]:
    """A served model none of whose chunks fits any tier: every Store of it is refused (no room).
    And a memory tier with a budget (0 turns it off) that holds a chunk of no served model. A tier
    too small for one model's chunks but not another's is how tiers are shared: not warned about. A
    quantized tier's chunks are smaller: not checked."""
    s = cfg.store
    sizes: dict[str, int] = {}
    for name in cfg.service.models:
        try:
            sizes[name] = get_model(name).layout.with_chunk_tokens(s.chunk_tokens).chunk_bytes
        except (UnknownModel, InvalidInput):  # refused when the service starts
            continue
    if not sizes:
        return []
    # An arena holds whole pages, and a chunk takes whole pages; LMDB charges a chunk more than its
    # bytes (a lower bound, then).
    tiers = [(tier, capacity, page) for tier, capacity, quantize, page in (
        ("device", s.device_capacity_bytes, s.quantize_device, s.page_bytes),
        ("dram", s.dram_capacity_bytes, s.quantize_dram, s.page_bytes),
        ("lmdb", s.lmdb_capacity_bytes, s.quantize_lmdb, 1)) if capacity > 0 and quantize == "off"]
    quantized = any(q != "off" for q in (s.quantize_device, s.quantize_dram, s.quantize_lmdb))

    def fits(cb: int, capacity: int, page: int) -> bool:
        return -(-cb // page) * page <= capacity // page * page

    out = []
    for tier, capacity, page in tiers:
        if tier != "lmdb" and not any(fits(cb, capacity, page) for cb in sizes.values()):
            least = min(sizes, key=lambda m: sizes[m])
            out.append(f"store.{tier}_capacity_bytes = {capacity} is less than one chunk of any served model (the "
                       f"smallest, '{least}', takes {-(-sizes[least] // page) * page} bytes"
                       f"{' in whole pages' if page > 1 else ''}): no chunk ever goes in the {tier} tier")
    if not quantized:
        for m, cb in sorted(sizes.items()):
            if not any(fits(cb, capacity, page) for _, capacity, page in tiers):
                out.append(f"no tier can hold one chunk of '{m}' ({cb} bytes): every Store of it is refused "
                           "(no room); raise a tier's capacity_bytes above that")
    return out


def _pool_below_a_snapshot(cfg: KvstoreConfig) -> list[str]:
    """An embedded pool, or a tenant's weighted share of it, that cannot hold one local snapshot of
    the largest served model: each StoreLocal of it is skipped (no-room), every time."""
    pool = cfg.local_pool
    if pool.url != "embedded":
        return []  # Redis's memory is its own maxmemory
    sizes = {}
    for name in cfg.service.models:
        try:
            nbytes = get_model(name).layout.local_snapshot_bytes
        except UnknownModel:  # refused when the service starts
            continue
        if nbytes > 0:  # a model with no local state stores nothing in the pool
            sizes[name] = nbytes
    if not sizes:
        return []
    model = max(sizes, key=lambda m: sizes[m])
    entry = sizes[model] + ENTRY_OVERHEAD_BYTES
    what = f"one local snapshot of '{model}' ({entry} bytes with the pool's {ENTRY_OVERHEAD_BYTES} B per entry)"
    if pool.capacity_bytes < entry:
        return [f"local_pool.capacity_bytes = {pool.capacity_bytes} is less than {what}: every StoreLocal of it "
                "is skipped (no-room)"]
    weights = cfg.share_weights()
    one_size = len(set(sizes.values())) == 1
    short = _short_tenants(pool.capacity_bytes, weights, entry, one_size)
    if not short:
        return []
    if one_size:
        enough, skipped = _least_capacity(pool.capacity_bytes, weights, entry), "are skipped"
    else:
        enough, skipped = math.ceil(entry * sum(weights.values()) / min(weights.values())), "may be skipped"
    return [f"local_pool.capacity_bytes = {pool.capacity_bytes} split by share_weight leaves {len(short)} tenant(s) "
            f"less room than {what} (e.g. '{short[0]}'): while the other tenants hold their shares, its "
            f"StoreLocals {skipped} (no-room); {enough} would give each one"]


def _short_tenants(capacity: int, weights: dict[str, float], entry: int, one_size: bool) -> list[str]:
    """The tenants that may find no room for an `entry` while every other tenant holds all it may
    keep within its weighted share (the smallest shares: every tenant holding snapshots; an idle
    one reserves nothing). Of one size, a tenant keeps whole entries: the rest of its share is room
    for the others. Of several, smaller entries may fill a share: only a share of one entry is sure."""
    shares = weighted_split(capacity, weights, weights)
    if not one_size:
        return [t for t, share in shares.items() if share < entry]
    kept = {t: share // entry * entry for t, share in shares.items()}
    held = sum(kept.values())
    return [t for t in shares if capacity - (held - kept[t]) < entry]


# The least capacity is looked for among this many whole numbers of entries above the one set; past
# them (shares of wildly different weights) the one that gives every share a whole entry is said.
LEAST_CAPACITY_TRIES = 10_000


def _least_capacity(capacity: int, weights: dict[str, float], entry: int) -> int:
    """The least capacity above `capacity` that leaves no tenant short of room for an entry of
    one size. Room only falls as a capacity grows where a share passes a whole entry, and rises one
    for one in between: the least is a whole number of entries."""
    every = math.ceil(entry * sum(weights.values()) / min(weights.values()))  # each share an entry
    first = capacity // entry + 1
    for k in range(first, min(first + LEAST_CAPACITY_TRIES, every // entry + 1)):
        if not _short_tenants(k * entry, weights, entry, True):
            return k * entry
    return every


def _zero_shares(cfg: KvstoreConfig) -> list[str]:
    """Runner slots or same-host sessions that some tenant has no share of: the tenants that come
    first may take them all (refused outright where attached runners are replay's only path)."""
    weights = cfg.share_weights()
    checks = []
    if cfg.runner_slots_shared() and cfg.replay.runner != "attached":
        checks.append(("service.max_runners", cfg.service.max_runners, cfg.runner_admin_weight(), "runners attached"))
    if cfg.shm_sessions_shared():
        checks.append(("service.max_shm_sessions", cfg.service.max_shm_sessions, 0.0,
                       "same-host sessions (the others' calls then go over streams)"))
    out = []
    for key, total, extra, what in checks:
        none = tenants_without_a_share(total, weights, extra)
        if none:
            out.append(f"{key} = {total} split by share_weight leaves {len(none)} tenant(s) no share (e.g. "
                       f"'{none[0]}'): the tenants that come first may hold every slot of {what}; "
                       f"{least_total(weights, extra)} would give each one")
    return out
