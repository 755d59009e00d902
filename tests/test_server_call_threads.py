"""gRPC's call threads under a host's thread limit (a cgroup's pids.max, `ulimit -u`), on a real
server on port 0 with real channels. The limit is a fault injected at thread start: `Thread.start`
raising what CPython raises when the host refuses a thread. Every call thread starts with the
server, so calls under load need none, and a host that cannot run them all refuses the start in
one line; should gRPC's dispatch thread end anyway, health says NOT_SERVING and stop still returns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
import grpc._server as grpc_server
import pytest

from kvstore.errors import ConfigError
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.fixtures.service import CHUNK, TOY, Service, make_config, payloads, tokens

POOL = "kvstore-grpc"  # the server's call threads are named so


def refuse_threads(monkeypatch: pytest.MonkeyPatch, prefix: str, allow: int = 0, times: int = 1 << 30) -> list[str]:
    """From now on, threads named `prefix...` fail to start as on a host at its limit: after `allow`
    have started, the next `times`. Returns the names refused."""
    real = threading.Thread.start
    started: list[str] = []
    refused: list[str] = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith(prefix):
            if len(started) >= allow and len(refused) < times:
                refused.append(self.name)
                raise RuntimeError("can't start new thread")
            started.append(self.name)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return refused


def test_a_burst_of_calls_under_a_thread_limit_is_served(make_service: Callable[..., Service],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service(make_config(service={"max_concurrent_calls": 16}))
    prompt = tokens(1, 2 * CHUNK)
    svc.client().store(TOY, prompt, payloads(1, 2, svc.chunk_bytes(TOY)))
    clients = [svc.client(timeout_seconds=5.0) for _ in range(12)]
    go = threading.Barrier(len(clients) + 1)
    outcomes: list[object] = []

    def work(i: int) -> None:
        go.wait()
        for _ in range(5):
            try:
                outcomes.append(len(clients[i].load(TOY, prompt).chunks))
            except Exception as e:
                outcomes.append(f"{type(e).__name__}: {str(e)[:100]}")

    workers = [threading.Thread(target=work, args=(i,)) for i in range(len(clients))]
    for w in workers:
        w.start()
    refused = refuse_threads(monkeypatch, POOL, times=3)  # a few, as a pids.max just reached
    go.wait()
    for w in workers:
        w.join()
    monkeypatch.undo()  # the limit is lifted
    assert outcomes == [2] * 60, sorted(map(str, outcomes))[:5]
    assert refused == []  # no call needed a thread the server did not already have
    after = svc.client(timeout_seconds=5.0)
    assert [len(after.load(TOY, prompt).chunks) for _ in range(5)] == [2] * 5
    assert svc.server.health.refresh()[""] == "SERVING"


def test_a_host_that_cannot_run_every_call_thread_refuses_the_start(make_service: Callable[..., Service],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_config()
    refuse_threads(monkeypatch, POOL, allow=5)
    with pytest.raises(ConfigError) as refusal:
        make_service(cfg)
    assert refusal.value.key == "service.max_concurrent_calls"
    assert "5 of" in refusal.value.problem and "can't start new thread" in refusal.value.problem
    assert "pids.max" in refusal.value.problem  # what to raise, besides the keys to lower
    monkeypatch.undo()
    # Nothing was left behind (ports, the data directory's lock): the same service starts now.
    svc = make_service(cfg)
    assert svc.client().lookup(TOY, tokens(1, CHUNK)).hit_tokens == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_is_not_serving_once_grpc_dispatch_thread_has_ended(
        service: Service, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def dies(state: object, event: object) -> bool:
        raise RuntimeError("can't start new thread")  # what ended it when its pool started threads

    # gRPC's loop looks its step up at each event: the next one (this call's) ends the loop.
    monkeypatch.setattr(grpc_server, "_process_event_and_continue", dies)
    with caplog.at_level(logging.ERROR, logger="kvstore.service"):
        with pytest.raises(grpc.RpcError) as unanswered:
            _lookup(service)
        assert unanswered.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        health = service.server.health.refresh()
    assert health[""] == health["kvstore.v1.KVCache"] == health["kvstore.v1.Runners"] == "NOT_SERVING"
    assert "gRPC's dispatch thread has ended" in caplog.text
    # Stopping waits for that thread to say it is done: it never will, and stop must return anyway.
    stopper = threading.Thread(target=service.stop, args=(0.5,), daemon=True)
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive()


def _lookup(svc: Service) -> None:
    """One Lookup on a channel of its own, with a short deadline."""
    with grpc.insecure_channel(svc.address) as channel:
        request = pb.LookupRequest(model=TOY, tokens=pb.Tokens(u32le=tokens(1, CHUNK).tobytes()))
        pb_grpc.KVCacheStub(channel).Lookup(request, timeout=2.0)
