"""The composition root: builds the store, the local pool, the runner registry and the replay
coordinator from one `KvstoreConfig`, and holds them for the servers that serve them.

Where other parts plug in (each is optional; the service runs without it):
- local pool: `kvstore.local_pool.build_local_pool(cfg.local_pool, ttl_policy, clock,
  cfg.share_weights())`, with the TTL policy from `kvstore.config.policies.build_ttl`
  (`App.reload_local_pool` swaps it on a config reload).
- replay: `replay.coordinator.build_coordinator(parts)`, given the parts it needs
  (`replay.port.ReplayParts`: the store, the local pool, the runner registry, the served models,
  `[replay]`, the chunk size, the clock), never the app. Absent: `app.coordinator` is None and an expired `Resume`
  reports "expired" without replaying.
- observability: append callables to `app.observers`; each gets a `kvstore.observe.records.CallRecord`
  after every KVCache call (method, tenant, status code name, seconds, the request's bills, its
  request id and the lookup facts the explainer needs), on the observer thread once the call has
  answered (`kvstore.observe.queue`); a reader that must see every finished call calls
  `app.flush_observers()` first. Every app with a local pool has one already:
  `kvstore.observe.returns.ReturnTracker`, which tells the TTL policy in force (`app.ttl_policy`)
  each session's return gap; with `[trace] enabled`, `kvstore.observe.trace_recorder.TraceRecorder`
  appends one JSON line per Lookup/Resume. The admin HTTP port is started by
  `kvstore.service.admin_server.start_admin(app, host, port, health=...)` (see `admin_hook.py`).

What it does not know: gRPC (see `server.py`), or how any of the parts do their work.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.config import KvstoreConfig, LocalPoolConfig
from kvstore.dataplane.segments import sealing_available, watching_available
from kvstore.errors import ConfigError, KvstoreError, StorageError, UnknownModel
from kvstore.layout import CacheLayout, ModelSpec, exact_replay_tokens, get_model
from kvstore.local_pool.base import LocalPool
from kvstore.local_pool.reload import differences
from kvstore.observe.queue import ObserverQueue
from kvstore.observe.records import CallObserver, CallRecord
from kvstore.observe.returns import ReturnTracker
from kvstore.observe.trace_file import TraceWriter
from kvstore.observe.trace_recorder import TraceRecorder
from kvstore.store import GlobalStore, TenantQuota
from policies.base import TtlPolicy
from policies.ttl import TenantTtls, carry_learning
from replay.port import ReplayParts, ReplayPort
from replay.registry import RunnerRegistry

log = logging.getLogger("kvstore.service")


@dataclass
class App:
    config: KvstoreConfig
    data_dir: Path
    models: dict[str, ModelSpec]
    store: GlobalStore
    local_pool: LocalPool | None
    runners: RunnerRegistry
    clock: Callable[[], float]
    coordinator: ReplayPort | None = None
    # Served models the coordinator's in-process runner can replay (set by the factory that builds
    # it): with `replay.runner = "reference"` and no served reference model, it can replay none.
    inprocess_replay_models: frozenset[str] = frozenset()
    ttl_policy: TtlPolicy | None = None  # the local pool's policy in force (None: unknown, or no pool)
    observers: list[CallObserver] = field(default_factory=list)
    # An explainer observes calls (the admin port is on): a lookup that misses takes down, when
    # it answers, which of its missed chunks the store holds (the explainer runs a moment later).
    explains_misses: bool = False
    on_close: list[Callable[[], None]] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    _closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _observe: ObserverQueue[CallRecord] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._observe = ObserverQueue(lambda: self.observers)

    def notify(self, record: CallRecord) -> None:
        """Hand a finished call's record to the observers (delivered after the call answers)."""
        if self.observers and self._observe is not None:
            self._observe.submit(record)

    def flush_observers(self, timeout_seconds: float = 5.0) -> bool:
        """Wait until the observers have seen every call finished so far; False on timeout."""
        return self._observe.flush(timeout_seconds) if self._observe is not None else True

    def layouts(self) -> dict[str, CacheLayout]:
        """Each served model's layout at the store's chunk size (what chunks and runners must match)."""
        # A copy of the items: RegisterModel may add a model while a runner attaches.
        return {n: m.layout.with_chunk_tokens(self.config.store.chunk_tokens) for n, m in list(self.models.items())}

    def model_layout(self, name: str) -> CacheLayout | None:
        """A served model's layout, None for one not served. Asked per call, unlike a copy of
        `layouts()`, so it finds a model an engine registered after start. At the model's own chunk
        size: its snapshot and replay sizes (what the request trace reads) do not depend on it."""
        spec = self.models.get(name)
        return spec.layout if spec is not None else None

    def reload_local_pool(self, new: KvstoreConfig | LocalPoolConfig) -> list[str]:
        """Apply a re-read config (`local_pool.reload.ConfigReloader`'s callback): the TTL policy's
        inputs, [local_pool.ttl] and each served tenant's `local_ttl_seconds`, take effect for new
        writes (and for stored snapshots when a hit refreshes them); `config` then shows the policy
        in force. A bare [local_pool] section brings its [local_pool.ttl] only. Other keys need a
        restart and are not applied. An adaptive policy's learning (each tenant's return gaps)
        carries over to the new one, whose costs and clamps then set the TTLs (`carry_learning`).
        Returns the dotted keys it applied, as the reloader names them."""
        ttl = new.ttl if isinstance(new, LocalPoolConfig) else new.local_pool.ttl
        applied = [key for key, _, _ in differences(self.config.local_pool.ttl, ttl, "local_pool.ttl")]
        tenants = self.config.tenants
        if isinstance(new, KvstoreConfig):
            # Only the local TTL of the tenants served now: tokens, quotas and new tenants need a restart.
            tenants = {name: dataclasses.replace(t, local_ttl_seconds=new.tenants[name].local_ttl_seconds)
                       if name in new.tenants else t for name, t in tenants.items()}
            applied += [f"tenants.{name}.local_ttl_seconds" for name, t in tenants.items()
                        if t.local_ttl_seconds != self.config.tenants[name].local_ttl_seconds]
        if not applied:
            return []  # only restart-only keys changed: the policy in force stays, nothing to rebuild
        cfg = dataclasses.replace(self.config, local_pool=dataclasses.replace(self.config.local_pool, ttl=ttl),
                                  tenants=tenants)
        if self.local_pool is not None:
            policy = build_ttl_policy(cfg, self.models)
            if self.ttl_policy is not None:
                # What an adaptive policy learnt carries over: one tenant's override, or a new cost,
                # must not send every tenant back to the start value.
                carry_learning(self.ttl_policy, policy)
            self.ttl_policy = policy
            self.local_pool.set_ttl_policy(policy)
        self.config = cfg
        return applied

    def local_ttls_in_force(self) -> dict[str, float]:
        """The TTL a default-size snapshot written now gets, per tenant served (`default` without
        [tenants]): an adaptive policy's learnt TTL, not its start value. Empty without a pool, or
        under a policy that cannot say."""
        policy = self.ttl_policy
        if self.local_pool is None or not isinstance(policy, TenantTtls):
            return {}
        return {name: policy.ttl_for_tenant(name) for name in list(self.config.tenants) or ["default"]}

    def describe(self) -> list[str]:
        """What this instance runs and where, for the start-up banner."""
        cfg = self.config
        st = self.store.stats()
        tiers = ", ".join(
            f"{name} {_size(t.capacity_bytes)}" + (f" on {t.backend}" if t.backend else "")
            for name, t in st.tiers.items()
        )
        device = st.tiers["device"].backend or "?"
        if device == "cpu":
            device += " (no CUDA: the device tier is host memory)"
        pool = cfg.local_pool.url if self.local_pool is not None else "none"
        if self.local_pool is not None and cfg.local_pool.url == "embedded":
            pool = f"embedded, {_size(cfg.local_pool.capacity_bytes)}"
        ttl = cfg.local_pool.ttl
        runner = "none"
        if self.coordinator is not None:
            runner = f"{cfg.replay.runner} ({cfg.replay.mode} replay)"
            if cfg.replay.runner == "reference" and not self.inprocess_replay_models:
                runner = f"attached only ({cfg.replay.mode} replay; no served model is the reference model)"
        elif cfg.replay.runner != "none":
            runner = f"{cfg.replay.runner} requested, but no replay coordinator is installed"
        auth = (
            f"bearer tokens / mTLS for {len(cfg.tenants)} tenant(s)" if cfg.auth_enabled
            else "off (one tenant 'default'; loopback only)"
        )
        return [
            f"tiers: {tiers}",
            f"device backend: {device}",
            f"data dir: {self.data_dir.resolve()} (lmdb durability {cfg.store.lmdb_durability}, "
            f"{cfg.store.write_policy})",
            f"models: {', '.join(self.models)}",
            f"local pool: {pool}; TTL policy {ttl.kind} {ttl.ttl_seconds:g} s",
            f"runner: {runner}; attached runners: {len(self.runners.runners())}",
            f"auth: {auth}",
        ]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.runners.close()
        if self._observe is not None:
            self._observe.close()  # before the observers' own resources (the trace file) close
        closer = getattr(self.coordinator, "close", None)
        if callable(closer):
            closer()
        if self.local_pool is not None:
            self.local_pool.close()
        for close in self.on_close:
            close()
        self.store.close()


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def served_models(cfg: KvstoreConfig) -> dict[str, ModelSpec]:
    out: dict[str, ModelSpec] = {}
    for i, name in enumerate(cfg.service.models):
        try:
            out[name] = get_model(name)
        except UnknownModel as e:
            raise ConfigError(f"service.models[{i}]", str(e)) from None
    return out


def in_place_loads(cfg: KvstoreConfig) -> bool:
    """Same-host clients will read chunks in place: the memory tiers are split between tenants."""
    svc = cfg.service
    return (bool(svc.unix_socket_path) and svc.shm_enabled and svc.shm_in_place
            and not sealing_available() and not watching_available())


def tenant_quotas(cfg: KvstoreConfig) -> dict[str, TenantQuota]:
    return {
        name: TenantQuota(t.quota_device_bytes, t.quota_dram_bytes, t.quota_lmdb_bytes)
        for name, t in cfg.tenants.items()
    }


def build_ttl_policy(cfg: KvstoreConfig, models: dict[str, ModelSpec]) -> TtlPolicy:
    from kvstore.config.policies import build_ttl

    # The pool's byte economics follow the served model with the largest snapshot.
    layouts = [m.layout for m in models.values()]
    layout = max(layouts, key=lambda lay: lay.local_snapshot_bytes)
    window = layout.local.window_tokens
    replay_tokens = exact_replay_tokens(layout) if cfg.replay.mode == "exact" else window
    overrides = {n: t.local_ttl_seconds for n, t in cfg.tenants.items() if t.local_ttl_seconds > 0}
    return build_ttl(cfg.local_pool.ttl, max(1, replay_tokens), max(1, layout.local_snapshot_bytes),
                     tenant_ttl_seconds=overrides)


def build_pool(cfg: KvstoreConfig, models: dict[str, ModelSpec], clock: Callable[[], float],
               policy: TtlPolicy | None = None) -> LocalPool:
    from kvstore.local_pool import build_local_pool

    # The embedded pool splits its budget by the tenants' weights, as the call slots are split.
    return build_local_pool(cfg.local_pool, policy or build_ttl_policy(cfg, models), clock, cfg.share_weights())


def install_observers(app: App) -> None:
    """The observers every service has: session returns for the TTL policy (with a pool), and the
    request trace when the config turns it on."""
    if app.local_pool is not None:
        # Each tenant's written boundaries are kept apart, split as the call slots are.
        app.observers.append(ReturnTracker(lambda: app.ttl_policy, app.clock,
                                           share_weights=app.config.share_weights()))
    if app.config.trace.enabled:
        try:
            writer = TraceWriter(app.config.trace.path, max_bytes=app.config.trace.max_bytes)
        except StorageError as e:
            raise ConfigError("trace.path", str(e)) from None
        tracer = TraceRecorder(writer, app.model_layout, clock=app.clock, share_weights=app.config.share_weights())
        app.observers.append(tracer)
        app.on_close.append(tracer.close)


def make_data_dir(ddir: Path) -> Path:
    """Create the data directory (and its parents); one that cannot be, or that this process cannot
    write in, is a config error naming it. Writing is tried with a probe file, created and removed:
    `os.access` says yes to root on a read-only mount."""
    import os
    import tempfile

    if ddir.exists() and not ddir.is_dir():
        raise ConfigError("data_dir", f"cannot use {ddir} as the data directory: it exists and is not a directory")
    try:
        ddir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError("data_dir", f"cannot create the data directory {ddir}: {e.strerror or e}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvstore-write-probe-", dir=ddir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError("data_dir", f"cannot write in the data directory {ddir}: {e.strerror or e}") from None
    _refuse_a_bare_copy(ddir)
    return ddir


def _refuse_a_bare_copy(ddir: Path) -> None:
    """A data directory holding an LMDB data file of its own, where kvstore keeps none (its LMDB is
    in `LMDB_SUBDIR`): a copy made by `mdb_copy DATA_DIR/lmdb COPY`, restored as `COPY`. Started
    on, it would serve nothing, a new empty LMDB made beside the copy, with no word of it."""
    from kvstore.tiers.factory import LMDB_SUBDIR

    if (ddir / "data.mdb").is_file() and not (ddir / LMDB_SUBDIR / "data.mdb").exists():
        raise ConfigError("data_dir", (
            f"{ddir} holds an LMDB data file (data.mdb) itself, where kvstore keeps it in {ddir / LMDB_SUBDIR}: "
            f"if it is a copy of a data dir's LMDB, move it there (mkdir {ddir / LMDB_SUBDIR} && "
            f"mv {ddir / 'data.mdb'} {ddir / LMDB_SUBDIR}/), or give another --data-dir"))


def check_devices(cfg: KvstoreConfig, *, replay: bool = True) -> None:
    """The device checks the store and the in-process replay runner make when they are built (a
    'cuda' that this machine lacks), made without building them: for check-config, and by
    build_app before it creates anything. `replay=False`: the caller supplies its own replay."""
    if cfg.store.device == "cuda":
        from kvstore.tiers.device import resolve_device

        try:  # as when the device tier is built
            resolve_device("cuda")
        except StorageError as e:
            raise ConfigError("store.device", str(e)) from None
    if replay and cfg.replay.device == "cuda" and cfg.replay.runner == "reference" and cfg.replay.mode != "off":
        from replay.reference.model import usable_device

        try:  # as replay.coordinator.build_coordinator does at start
            usable_device("cuda")
        except KvstoreError as e:
            raise ConfigError("replay.device", str(e)) from None


def build_app(
    cfg: KvstoreConfig,
    data_dir: str | Path | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    local_pool: LocalPool | str | None = "config",
    coordinator_factory: Callable[[ReplayParts], ReplayPort | None] | str | None = "config",
    progress: Callable[[str], None] | None = None,
) -> App:
    """Build every part from `cfg`. Tests pass `local_pool` / `coordinator_factory` to substitute
    a part (None: leave it out); "config" builds what the config asks for. `progress` is told, a
    line at a time, about slow work at start (building an LMDB index once, pre-faulting arenas)."""
    check_devices(cfg, replay=coordinator_factory == "config")  # before anything is created
    ddir = make_data_dir(Path(data_dir if data_dir is not None else cfg.data_dir))
    models = served_models(cfg)
    store = GlobalStore(cfg.store, ddir, list(models.values()), tenant_quotas(cfg), clock=clock, progress=progress,
                        load_index_in_background=cfg.store.load_index == "background",
                        arena_owners=cfg.share_weights() if in_place_loads(cfg) else None)
    try:
        policy = build_ttl_policy(cfg, models) if local_pool == "config" else None
        pool = build_pool(cfg, models, clock, policy) if local_pool == "config" else local_pool
        assert not isinstance(pool, str)
        runners = RunnerRegistry(cfg.service.max_runners, cfg.share_weights(),
                                 admin_runners=cfg.runner_admin_weight() > 0)
        # Models engines registered before a restart are served again (the store recovered them).
        app = App(cfg, ddir, {**models, **store.engine_models()}, store, pool, runners, clock, ttl_policy=policy)
        parts = ReplayParts(store, pool, app.runners, models, cfg.replay, cfg.store.chunk_tokens, clock)
        if coordinator_factory == "config":
            if cfg.replay.runner != "none" and cfg.replay.mode != "off":
                from replay.coordinator import build_coordinator  # torch is imported only when replay is on

                built = build_coordinator(parts)
                if built is not None:
                    app.coordinator, app.inprocess_replay_models = built.coordinator, built.inprocess_models
        elif coordinator_factory is not None:
            assert not isinstance(coordinator_factory, str)
            app.coordinator = coordinator_factory(parts)
        install_observers(app)
    except BaseException:
        store.close()
        raise
    return app
