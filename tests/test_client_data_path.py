"""The client's choice of data path against a real service on a Unix socket: a restart that turns
shared memory off sends every read over streams, and a load left early gives its leases back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import KvstoreClient
from kvstore.client.sync_client import UnavailableError
from tests.fixtures.service import CHUNK, DENSE, TOY, V41, Service, payloads, tokens
from tests.helpers.waiting import wait_until
from tests.test_service_shm import shm_config


def _chunks(got: Any) -> list[bytes]:
    return [bytes(c) for c in got]


# Each the first call after the restart: it is the one that must drop the session the client held.
READS: dict[str, Callable[[KvstoreClient, Any, int], list[bytes]]] = {
    "load": lambda kv, p, cb: _chunks(kv.load(TOY, p).chunks),
    "load_into": lambda kv, p, cb: (lambda buf: [bytes(buf[i * cb : (i + 1) * cb]) for i in range(
        kv.load_into(TOY, p, buf).loaded_chunks)])(bytearray(4 * cb)),
    "iter_load": lambda kv, p, cb: [bytes(v) for _, _, v in kv.iter_load(TOY, p)],
    "resume": lambda kv, p, cb: _chunks(kv.resume(TOY, p).chunks),
    "load_local": lambda kv, p, cb: [] if kv.load_local(TOY, p).snapshot is None else ["?"],  # type: ignore[list-item]
    "lookup_held": lambda kv, p, cb: (lambda h: (h.release(), [b"x"] * h.result.hit_chunks)[1])(
        kv.lookup_held(TOY, p, hold_chunks=4)),
}


def _load_shared(kv: KvstoreClient, p: Any, cb: int) -> list[bytes]:
    with kv.load_shared(TOY, p) as got:
        return _chunks(got.chunks)


READS["load_shared"] = _load_shared


@pytest.mark.parametrize("read", sorted(READS))
def test_a_restart_without_shared_memory_sends_every_read_over_streams(
    make_service: Callable[..., Service], sock_dir: Path, read: str,
) -> None:
    # The restarted service refused the old session without naming it unknown: the client kept it,
    # and every read failed INVALID_ARGUMENT for as long as the client lived.
    sock = sock_dir / "kv.sock"
    svc = make_service(shm_config(sock))
    cb = svc.chunk_bytes(TOY)
    prompt, want = tokens(7, 4 * CHUNK), payloads(7, 4, cb)
    kv = KvstoreClient(f"unix://{sock}", timeout_seconds=10.0)
    try:
        kv.store(TOY, prompt, want)
        assert kv.data_path_in_use == "shm", kv.shm_detail
        svc.stop(0.5)
        make_service(shm_config(sock, shm_enabled=False), data_dir=svc.data_dir)
        expect = {"load_local": [], "lookup_held": [b"x"] * 4}.get(read, want)
        for _ in range(2):  # the call that drops the session, and one after it
            assert READS[read](kv, prompt, cb) == expect
            assert kv.data_path_in_use == "stream"
    finally:
        kv.close()


@pytest.mark.parametrize("in_place", [False, True])
def test_leaving_iter_load_early_gives_back_every_lease(
    make_service: Callable[..., Service], sock_dir: Path, in_place: bool,
) -> None:
    # The spans sent after the one the caller stopped in stayed leased for shm_lease_seconds (30 s):
    # the session's load segment filled, and its next loads waited for room until their deadline.
    svc = make_service(shm_config(sock_dir / "kv.sock", shm_in_place=in_place))
    cb = svc.chunk_bytes(V41)
    prompt, want = tokens(5, 200 * CHUNK), payloads(6, 200, cb)  # 2.8 MB: two spans of the 4 MiB segment
    kv = KvstoreClient(f"unix://{sock_dir / 'kv.sock'}", timeout_seconds=10.0)
    try:
        kv.store(V41, prompt, want)
        for _ in range(30):
            for index, _tier, view in kv.iter_load(V41, prompt):
                assert (index, bytes(view)) == (0, want[0])
                break  # the caller only wanted the first chunk
        assert kv.data_path_in_use == "shm"

        def leases() -> int:
            dp = kv.stats().data_plane
            assert dp is not None
            return dp.sessions[0].leases_active

        # Releases travel on the side socket, beside the calls: the last may land after the reply.
        wait_until(lambda: leases() == 0, timeout=5.0)
        assert _chunks(kv.load(V41, prompt, timeout_seconds=5.0).chunks) == want
    finally:
        kv.close()


def test_data_path_shm_refuses_every_fallback_to_streams(make_service: Callable[..., Service], sock_dir: Path) -> None:
    # "shm" went over streams without a word for a model whose chunks are too large for the
    # session, and for a Store that found the store segment full: a benchmark that pins the path
    # measured streams as shared memory. "auto" still falls back.
    sock = sock_dir / "kv.sock"
    svc = make_service(shm_config(sock, shm_load_segment_bytes=2 << 20, models=[TOY, V41, DENSE]))
    cb = svc.chunk_bytes(DENSE)  # 2 MiB chunks: more than half the load segment
    prompt, want = tokens(47, 2 * CHUNK), payloads(48, 2, cb)
    auto = KvstoreClient(f"unix://{sock}", timeout_seconds=10.0)
    insist = KvstoreClient(f"unix://{sock}", timeout_seconds=10.0, data_path="shm")
    try:
        assert insist.store(DENSE, prompt, want).stored_chunks == 2
        assert _chunks(auto.load(DENSE, prompt).chunks) == want
        with auto.load_shared(DENSE, prompt) as got:
            assert got.path == "stream"

        def shared() -> None:
            with insist.load_shared(DENSE, prompt):
                pass

        too_large: list[Callable[[], object]] = [
            lambda: insist.load(DENSE, prompt), lambda: insist.load_into(DENSE, prompt, bytearray(2 * cb)),
            lambda: list(insist.iter_load(DENSE, prompt)), lambda: insist.resume(DENSE, prompt), shared]
        for call in too_large:  # the first learns the size from the service, the rest from the client
            with pytest.raises(UnavailableError, match="too large for the same-host session"):
                call()
        assert insist.data_path_in_use == "shm"

        # A Store that finds the store segment held by others (here: held by the test).
        small, small_want = tokens(49, 2 * CHUNK), payloads(50, 2, svc.chunk_bytes(TOY))
        for kv in (auto, insist):
            shm = kv._shm_path()
            assert shm is not None
            held = shm.hold_staging(shm.store_bytes)
            assert held is not None
            try:
                if kv is auto:
                    assert kv.store(TOY, small, small_want).stored_chunks == 2
                else:
                    with pytest.raises(UnavailableError, match="store segment has no room"):
                        kv.store(TOY, small, small_want, skip_present=False)
            finally:
                shm.release_staging(held[0])
        assert _chunks(insist.load(TOY, small).chunks) == small_want
    finally:
        auto.close()
        insist.close()
