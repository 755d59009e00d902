"""The global-KV store: the bookkeeper. It decides; it never touches bytes itself.

It owns the index (chunk key -> which tiers hold the chunk, its tenant, its token ids), the byte
budgets per tier and per tenant, the pins, and the policies. It asks tiers to move bytes. This
module builds it (`GlobalStore`, the one object the service holds, its state all set up here) and
closes it; the bookkeeping is mixed in, one part a module, each working on that state:
- models.py: the models served (the config's, and those engines register at run time, recorded
  in LMDB and recovered at start), their layouts, namespaces and token validation;
- lookups.py: a lookup walks the chained keys and stops at the first key it does not hold (or
  whose stored token ids differ from the request's: a miss, counted);
- commits.py: a store is two-phase: `begin_store` -> `write` -> `commit` reserves room for the
  longest head of the prefix that fits, writes those chunks durably in ONE LMDB transaction
  (write-through), then places them in the hot tier and makes them visible; `abort` leaves nothing;
- reads.py: a load reads the hit prefix from the fastest tier holding each chunk, pinned only
  while it is read, and promotes and touches what it read;
- placement.py: pressure demotes device -> DRAM -> LMDB -> dropped, choosing victims with the
  tier's eviction policy, never a pinned chunk, and never exceeding a tier's capacity or a
  tenant's quota; deferred_lmdb.py: the LMDB deletes and writes that leaves, after the lock;
- namespaces.py: the record in LMDB of each namespace holding chunks, and each tenant's share;
- index_load.py: the index rebuilt from LMDB at start, before listening or in the background;
- accounting.py: the counters, the service's and each tenant's (`stats`, `tenant_stats`), and
  `check_invariants`.

What it does not know: how bytes are laid out in memory or on disk (tiers), how victims are
ranked (policies), gRPC, tenants' credentials, or local SWA state (the local pool).

Locking: one re-entrant lock guards the index and the in-memory tiers. The slow LMDB work of a
commit happens outside it: the durable write, before the new chunks become visible, and the
deletes of the chunks evicted to make room and the writes of those demoted into LMDB, in one
transaction per commit (deferred_lmdb.py). A commit takes the lock for at most
CHUNKS_PER_LOCK_HOLD chunks at a time (store_lock.py). A model registration writes its record (and
the tiers learn its layout) outside it too, between a reservation that counts in the limits and the
model being served.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvstore.config.policies import build_admission, build_eviction
from kvstore.config.store import StoreConfig
from kvstore.keys.memo import KeyMemo
from kvstore.layout import TIER_NAMES, ModelSpec
from kvstore.store.accounting import Accounting
from kvstore.store.cold import ColdChunks
from kvstore.store.commits import Commits
from kvstore.store.fates import ChunkFateSink, NoFates
from kvstore.store.index_load import IndexLoad
from kvstore.store.lookups import Lookups
from kvstore.store.models import Models
from kvstore.store.pins import PinTable
from kvstore.store.placement import HOT_TIERS, ChunkEntry, Demotion
from kvstore.store.reads import Reads
from kvstore.store.store_lock import StoreLock
from kvstore.store.types import TenantQuota
from kvstore.tiers.arena import PagedArena
from kvstore.tiers.base import DurableTier, Tier, TierName
from kvstore.tiers.factory import build_tiers, quantize_tiers
from policies.base import AdmissionPolicy, EvictionPolicy

# The LMDB tier's eviction policy keeps this many of its newest keys (per queue) as objects and the
# rest as arrays (policies/key_log.py): it tracks nearly every chunk. The memory tiers' track few.
LMDB_POLICY_YOUNG_KEYS = 64


# The parts are listed before the ones whose placeholders they fill (Reads' `_walk`, `layout`,
# `_bump_tenant`; Placement's): the method resolution order then finds the real method first.
class GlobalStore(Commits, Lookups, Models, Accounting, Reads, IndexLoad):
    def __init__(
        self,
        cfg: StoreConfig,
        data_dir: Path,
        models: Sequence[ModelSpec],
        quotas: Mapping[str, TenantQuota] | None = None,
        clock: Callable[[], float] = time.monotonic,
        progress: Callable[[str], None] | None = None,
        load_index_in_background: bool = False,
        arena_owners: Mapping[str, float] | None = None,
    ) -> None:
        """`progress` is told, a line at a time, about slow work at start (building the LMDB index
        of a data directory of an older format, loading the index in the background).
        `load_index_in_background`: return before the LMDB tier's chunks are indexed and index them
        on a thread; until then (`ready`), the store answers from what it has indexed so far and
        keeps what it is given in memory only (see index_load.py). `arena_owners` (tenant -> weight)
        splits the in-memory tiers between those tenants, so that their same-host clients can read
        chunks in place (`hold_in_place`); each tenant is then kept within its part."""
        self.cfg = cfg
        self._clock = clock
        self._models = {m.name: m for m in models}
        self._chunk_layouts = {}
        # Chunk geometry comes from the config, so one store has one chunk size.
        self._layouts = {self._layout_for(m).layout_id: self._layout_for(m) for m in models}
        self._quotas = dict(quotas or {})
        self._lock = StoreLock()
        self._index: dict[bytes, ChunkEntry] = {}
        self._cold = ColdChunks()
        self._pins = PinTable()
        self._memo = KeyMemo(cfg.key_memo_bytes)
        layouts = list(self._layouts.values())
        built = build_tiers(cfg, Path(data_dir), layouts, progress, arena_owners)
        # An arena split between tenants holds each one's chunks within its part: a limit like a quota.
        self._parts: dict[TierName, dict[str, int]] = {
            t: caps for t, arena in zip(HOT_TIERS, built[:2], strict=True)
            if (caps := arena.owner_capacities()) is not None}
        self._arenas: dict[TierName, PagedArena] = dict(zip(HOT_TIERS, built[:2], strict=True))
        device, dram, lmdb = quantize_tiers(cfg, layouts, *built)
        self._durable: DurableTier = lmdb
        self._tiers: dict[TierName, Tier] = {"device": device, "dram": dram, "lmdb": lmdb}
        self._policies: dict[TierName, EvictionPolicy] = {
            t: build_eviction(cfg.eviction_policy, young_keys=LMDB_POLICY_YOUNG_KEYS if t == "lmdb" else None)
            for t in TIER_NAMES
        }
        self._admission: AdmissionPolicy = build_admission(cfg.admission_policy)
        self._hot_room = any(self._tiers[t].capacity_bytes > 0 for t in HOT_TIERS)  # promotion can land
        self._used: dict[TierName, int] = dict.fromkeys(TIER_NAMES, 0)
        self._tenant_used: dict[tuple[str, TierName], int] = {}
        # The namespace records and their shares (namespaces.py says what each of these holds).
        self._known_ns: dict[bytes, str] = {}
        self._ns_chunks: dict[bytes, int] = {}
        self._ns_records: dict[bytes, bytes] = {}
        self._ns_of_tenant: dict[str, int] = {}
        self._ns_committing: dict[bytes, int] = {}
        self._ns_writing: dict[bytes, threading.Event] = {}
        self._ns_demoting: dict[bytes, tuple[threading.Event, str, bytes]] = {}
        self._ns_doomed: set[bytes] = set()
        self._ns_deleting: dict[bytes, threading.Event] = {}
        self._ns_kept: set[bytes] = set()
        self._ns_all_counted = False
        self._counters: dict[str, int] = {}
        # The same counters per tenant: a tenant's Stats answers its own figures, never another's.
        self._tenant_counters: dict[str, dict[str, int]] = {}
        # Each tenant's pins, beside the pin table's totals (reads.py).
        self._pin_owners: dict[int, tuple[str, float]] = {}
        self._pins_active_of: dict[str, int] = {}
        self._by_tier: dict[str, int] = {}
        self._ignored: dict[str, int] = {}
        self._ignored_bytes = 0  # on disk, of the chunks counted in _ignored
        self._fates: ChunkFateSink = NoFates()  # told when a chunk leaves or is kept out (the explainer)
        self._doomed: set[bytes] = set()
        self._overage: dict[tuple[str | None, TierName], int] = {}
        self._deleting: dict[bytes, threading.Event] = {}
        self._committing: dict[bytes, int] = {}
        self._demoting: dict[bytes, Demotion] = {}  # victims on their way into LMDB (deferred_lmdb.py)
        self._demoting_bytes: dict[int, int] = {}
        self._registered_by: dict[str, str] = {}  # engine model name -> the tenant that registered it
        # Engine model name -> every tenant that registered it (the same description registered by a
        # second tenant is the same model): the models each tenant's Stats lists.
        self._registrants: dict[str, set[str]] = {}
        # Engine model name -> the registration writing its record now (another waits for it).
        self._models_writing = {}
        # What retiring registered models reads (models.py says what each holds).
        self._engine_descs = {}
        self._used_at = {}
        self._ns_model = {}
        self._stores_open = weakref.WeakSet()
        self._progress = progress or (lambda line: None)
        # The startup index load (index_load.py).
        self._ready = threading.Event()
        self._stop_loading = threading.Event()
        self._load_error = ""
        self._index_at_start = self._durable.stats().entries
        self._index_loaded = 0
        self._load_seconds = 0.0
        self._loader: threading.Thread | None = None
        self._recover_engine_models()
        self._recover_namespaces()
        self._cold = ColdChunks(self._index_at_start)
        if load_index_in_background and self._index_at_start:
            self._loader = threading.Thread(target=self._load_index_thread, name="kvstore-index", daemon=True)
            self._loader.start()
        else:
            self._load_index()

    def set_fate_sink(self, sink: ChunkFateSink) -> None:
        self._fates = sink

    def close(self) -> None:
        if self._loader is not None:  # it reads the LMDB environment, which closes below
            self._stop_loading.set()
            self._loader.join()
        self._delete_doomed()  # else evicted chunks would be found again at the next start
        self._write_demotions(everyone=True)
        with self._lock:
            for t in self._tiers.values():
                t.close()
