"""The host memory a config plans (`kvstore/tiers/host_memory.py` judges it): what `serve`
refuses or warns about before any arena is allocated, and `check-config` reports on this machine."""

from __future__ import annotations

from kvstore.config import KvstoreConfig
from kvstore.tiers.host_memory import HostNeed, Verdict, judge, read_host_memory


def host_memory_verdict(cfg: KvstoreConfig) -> Verdict:
    """The memory backed at start (prefaulted or pinned arenas) and what grows with use (the embedded
    pool, same-host segments), against what this process may take."""
    from kvstore.service.app import in_place_loads
    from kvstore.tiers.factory import host_arenas

    needs = host_arenas(cfg.store, split=in_place_loads(cfg))
    if cfg.local_pool.url == "embedded":
        needs.append(HostNeed(("local_pool.capacity_bytes",), cfg.local_pool.capacity_bytes))
    svc = cfg.service
    if svc.unix_socket_path and svc.shm_enabled:
        # Every session's two segments, and the spare load segment's resident part.
        needs.append(HostNeed(
            ("service.max_shm_sessions", "service.shm_load_segment_bytes", "service.shm_store_segment_bytes"),
            svc.max_shm_sessions * (svc.shm_load_segment_bytes + svc.shm_store_segment_bytes)
            + min(svc.shm_prefault_bytes, svc.shm_load_segment_bytes),
            what="same-host segments (service.max_shm_sessions × (shm_load_segment_bytes + shm_store_segment_bytes))"))
    return judge(needs, read_host_memory())
