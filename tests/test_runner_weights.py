"""Runner weights: a result is checked for its size only, so a runner with other weights than the
service's (`kvstore runner --seed 1` beside `replay.reference_seed = 0`) would have its snapshots
pooled and served as the model's. The hello declares the runner's weights; other weights are
refused at attach, none (an older runner) are accepted unverified. Real service, real gRPC, the
real `kvstore runner` process; the Runners servicer is built as KvstoreServer builds it, told the
weights each model's runners must declare."""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest

from kvstore.layout import EngineLayerGroup, EngineModel, register_model
from kvstore.service.runners_servicer import RunnersServicer, expected_weights
from kvstore.service.server import generic_handler, transport_options
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pbg
from kvstore.workload.demo import Engine, OffsetClock
from tests.fixtures.service import CHUNK, Service, make_config
from tests.test_replay_coordinator import MODEL, NAME, SPEC, W, tokens, wait_for

register_model(SPEC)


@dataclass
class Runners:
    """A Runners server beside a service, sharing its registry (so its runners take its replays)."""

    svc: Service
    servicer: RunnersServicer
    address: str


@pytest.fixture
def make_runners(make_service: Callable[..., Service]) -> Iterator[Callable[..., Runners]]:
    servers: list[grpc.Server] = []

    def make(reference_seed: int = 0, require_weights: bool = False, **kw: Any) -> Runners:
        cfg = make_config(replay={"runner": "attached", "mode": "exact", "device": "cpu",
                                  "reference_seed": reference_seed, "require_runner_weights": require_weights},
                          service={"models": [NAME], "max_concurrent_calls": 8},
                          local_pool={"capacity_bytes": 1 << 20, "ttl": {"kind": "fixed", "ttl_seconds": 60.0}})
        svc = make_service(cfg, **kw)
        app, s, sc = svc.app, svc.server, cfg.service
        servicer = RunnersServicer(
            app.runners, s.auth, app.layouts, sc.stream_message_bytes, sc.max_message_bytes, lambda: False,
            s.watch, None, sc.stream_idle_seconds, hidden_models=app.store.hidden_models,
            expected_weights=expected_weights(app.models, cfg.store.chunk_tokens, cfg.replay.reference_seed),
            require_weights=cfg.replay.require_runner_weights)
        server = grpc.server(ThreadPoolExecutor(max_workers=8), options=transport_options(sc))
        server.add_generic_rpc_handlers((generic_handler("Runners", servicer, sc.max_message_bytes),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return Runners(svc, servicer, f"127.0.0.1:{port}")

    yield make
    for server in servers:
        server.stop(0.5)


def spawn_runner(address: str, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "kvstore", "runner", "--connect", address, "--window", str(W),
           "--chunk-tokens", "16", "--device", "cpu", "--log-level", "warning", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


class Hello:
    """A runner's side of Attach that says hello and stays: `refusal` is the error that ended it."""

    def __init__(self, address: str, model: str, layout_id: bytes, weights: str) -> None:
        self.out: queue.Queue[pb.RunnerMessage | None] = queue.Queue()
        self.out.put(pb.RunnerMessage(hello=pb.RunnerHello(
            model=model, layout_id=layout_id, device="cpu", max_concurrent_jobs=1, max_batch=1, weights=weights)))
        self.channel = grpc.insecure_channel(address)
        self.call = pbg.RunnersStub(self.channel).Attach(iter(self.out.get, None))

    def attached(self) -> bool:
        return next(iter(self.call)).WhichOneof("kind") == "attached"

    def refusal(self) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as e:
            next(iter(self.call))
        return e.value

    def close(self) -> None:
        self.out.put(None)
        self.call.cancel()
        self.channel.close()


def _refused(address: str, model: str, layout_id: bytes, weights: str) -> grpc.RpcError:
    """The service's answer to a hello declaring `weights`, expected to be a refusal."""
    hello = Hello(address, model, layout_id, weights)
    try:
        return hello.refusal()
    finally:
        hello.close()


def test_a_runner_with_another_seed_is_refused_and_the_command_exits_2(
        make_runners: Callable[..., Runners]) -> None:
    r = make_runners(reference_seed=0)
    proc = spawn_runner(r.address, "--seed", "1")
    try:
        out, _ = proc.communicate(timeout=120)  # before the check it attached and stayed
    finally:
        proc.kill()
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    (line,) = [ln for ln in out.splitlines() if "refused this runner: INVALID_ARGUMENT" in ln]
    assert "'1+seed=1'" in line and "'1+seed=0'" in line and "--seed 0" in line and NAME in line, line
    assert r.svc.app.runners.runners() == [] and r.servicer.refused_total == 1


def test_a_runner_with_the_service_seed_attaches_and_replays_the_truth(
        make_runners: Callable[..., Runners]) -> None:
    clock = OffsetClock()
    r = make_runners(reference_seed=0, clock=clock)
    proc = spawn_runner(r.address)  # --seed 0, the default
    try:
        wait_for(lambda: len(r.svc.app.runners.runners()) == 1 or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        client = r.svc.client(timeout_seconds=60)
        eng = Engine(MODEL, client, NAME, "exact")
        p = tokens(9, 100)
        eng.store(p, eng.request(p))
        clock.advance(61)  # the local snapshot expired: the runner rebuilds it
        got = client.resume(NAME, p, "exact")
        assert (got.local_state, got.replay_status) == ("replayed", "replayed")
        assert got.snapshot == MODEL.prefill(p[:96].astype(np.int64)).snapshot
        assert (r.servicer.refused_total, r.servicer.unverified_total) == (0, 0)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


def test_a_hello_is_checked_against_the_configured_reference_seed(
        make_runners: Callable[..., Runners], caplog: pytest.LogCaptureFixture) -> None:
    r = make_runners(reference_seed=3)
    lid = r.svc.app.layouts()[NAME].layout_id
    e = _refused(r.address, NAME, lid, "1+seed=0")
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    said = str(e.details())
    assert "'1+seed=0'" in said and "'1+seed=3'" in said and "--seed 3" in said and "\n" not in said, said
    assert r.svc.app.runners.runners() == [] and r.servicer.refused_total == 1
    right = Hello(r.address, NAME, lid, "1+seed=3")
    with caplog.at_level(logging.WARNING, logger="kvstore.service.runners_servicer"):
        older = Hello(r.address, NAME, lid, "")  # a runner older than the field: attached, unverified
    try:
        assert right.attached() and older.attached()
        assert len(r.svc.app.runners.runners()) == 2
        assert (r.servicer.refused_total, r.servicer.unverified_total) == (1, 1)
        unverified = [m for m in caplog.messages if "declares no weights identity" in m]
        assert len(unverified) == 1 and "'1+seed=3'" in unverified[0]
    finally:
        right.close()
        older.close()


def test_a_runner_that_declares_no_weights_is_refused_where_the_config_requires_them(
        make_runners: Callable[..., Runners]) -> None:
    r = make_runners(require_weights=True)
    lid = r.svc.app.layouts()[NAME].layout_id
    e = _refused(r.address, NAME, lid, "")  # an older runner: no weights in its hello
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    said = str(e.details())
    assert "declares no weights identity" in said and "replay.require_runner_weights" in said, said
    assert "'1+seed=0'" in said and "\n" not in said, said
    assert r.svc.app.runners.runners() == [] and (r.servicer.refused_total, r.servicer.unverified_total) == (1, 0)
    right = Hello(r.address, NAME, lid, "1+seed=0")
    try:
        assert right.attached() and len(r.svc.app.runners.runners()) == 1
    finally:
        right.close()


def test_an_engine_models_runner_must_declare_the_revision_the_engine_registered(
        make_runners: Callable[..., Runners]) -> None:
    r = make_runners()
    full = EngineLayerGroup("full", num_layers=2, kv_heads=2, head_size=8, dtype="bfloat16")
    swa = EngineLayerGroup("sliding", num_layers=2, kv_heads=1, head_size=8, dtype="float32", sliding_window=20)
    model = r.svc.client().register_model(
        EngineModel("llama", "weights-abc", (full, swa), chunk_tokens=CHUNK, vocab_size=1000)).model
    lid = r.svc.app.layouts()[model].layout_id
    e = _refused(r.address, model, lid, "weights-xyz")
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'weights-xyz'" in str(e.details()) and "'weights-abc'" in str(e.details())
    right = Hello(r.address, model, lid, "weights-abc")
    try:
        assert right.attached() and [x.model for x in r.svc.app.runners.runners()] == [model]
    finally:
        right.close()


def test_the_expected_weights_of_a_model_not_run_by_the_reference_model_are_its_revision() -> None:
    from kvstore.layout import get_model

    v41 = get_model("deepseek-v4.1-flash")
    of = expected_weights({v41.name: v41, NAME: SPEC}, 16, 5)
    want = of(v41.name)
    assert want is not None and want.identity == v41.revision
    ref = of(NAME)
    assert ref is not None and ref.identity == f"{SPEC.revision}+seed=5"
    assert of("not-served") is None
