"""Abusive clients, each a thing that starts, runs against a service and stops, and the victim
whose calls they must not disturb. `kvstore bench abuse` runs each against a live service; the
hardening tests run them with a victim and check the victim's calls and the server's bounds.

gRPC-level abusers speak the service's own API through raw stubs (a real client would split,
retry or time out what these hold open on purpose); the HTTP/2-level ones live in `h2_abusers`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _tokens(token_ids: np.ndarray) -> pb.Tokens:
    return pb.Tokens(u32le=np.asarray(token_ids, dtype="<u4").tobytes())


class Abuser:
    """Something that holds or floods the service until `stop()`."""

    name = "abuser"

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def outcome(self) -> dict[str, object]:
        """What the abuser saw (e.g. the status codes its calls ended with)."""
        return {}


@dataclass
class _Streams:
    """Streams held open by threads, their final status codes collected."""

    codes: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ended(self, e: grpc.RpcError | None) -> None:
        with self.lock:
            if e is None:
                self.codes.append("OK")
                self.details.append("")
            else:
                self.codes.append(e.code().name)
                self.details.append(e.details() or "")


class IdleStoreStreams(Abuser):
    """Opens `streams` Store calls, sends a header (and optionally `piece_bytes` of payload per
    stream), then sends nothing more and never ends them (no deadline)."""

    name = "idle_store_streams"

    def __init__(self, address: str, token: str | None, model: str, token_ids: np.ndarray, streams: int,
                 chunk_bytes: int = 0, pieces: int = 0, piece_bytes: int = 0) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.KVCacheStub(self._channel)
        self._md = _metadata(token)
        self._model = model
        self._tokens = token_ids
        self._n = streams
        self._chunk_bytes = chunk_bytes
        self._pieces = pieces
        self._piece_bytes = piece_bytes
        self._release = threading.Event()
        self._progress = threading.Condition()
        self._sent: set[int] = set()
        self.streams = _Streams()
        self._futures: list[grpc.Future] = []

    def _messages(self, i: int) -> Iterator[pb.StoreRequest]:
        msgs = [pb.StoreRequest(header=pb.StoreHeader(model=self._model, tokens=_tokens(self._tokens)))]
        payload = bytes(self._piece_bytes)
        for k in range(self._pieces):
            pos = k * self._piece_bytes
            msgs.append(pb.StoreRequest(chunks=pb.ChunkPiece(
                first_chunk=pos // self._chunk_bytes, offset=pos % self._chunk_bytes, data=payload)))
        for k, m in enumerate(msgs):
            if k == len(msgs) - 1:  # the last one is handed to gRPC: this stream has sent all it will
                with self._progress:
                    self._sent.add(i)
                    self._progress.notify_all()
            yield m
        self._release.wait()  # hold the stream open, sending nothing

    def start(self) -> None:
        for i in range(self._n):
            fut = self._stub.Store.future(self._messages(i), metadata=self._md)
            fut.add_done_callback(self._done)
            self._futures.append(fut)

    def _done(self, fut: grpc.Future) -> None:
        if not fut.cancelled():  # cancelled: by `stop()`, nothing to learn
            err = fut.exception()
            self.streams.ended(err if isinstance(err, grpc.RpcError) else None)
        with self._progress:
            self._progress.notify_all()

    def wait_sent(self, timeout_seconds: float = 30.0) -> int:
        """Wait until every stream has sent all it will send or has ended; how many are holding."""
        def settled() -> bool:
            return all(i in self._sent or f.done() for i, f in enumerate(self._futures))

        with self._progress:
            self._progress.wait_for(settled, timeout_seconds)
        return sum(1 for f in self._futures if not f.done())

    def wait_ended(self, timeout_seconds: float) -> bool:
        end = time.monotonic() + timeout_seconds
        while time.monotonic() < end:
            if all(f.done() for f in self._futures):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        for f in self._futures:
            f.cancel()
        self._release.set()
        self._channel.close()

    def outcome(self) -> dict[str, object]:
        return {"codes": list(self.streams.codes)}


class UnreadLoadStreams(Abuser):
    """Opens `streams` Load calls of a stored prefix and never reads past their first message."""

    name = "unread_load_streams"

    def __init__(self, address: str, token: str | None, model: str, token_ids: np.ndarray, streams: int) -> None:
        # A small window: the server's sends block once a few messages are unread.
        self._channel = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
        self._stub = pb_grpc.KVCacheStub(self._channel)
        self._md = _metadata(token)
        self._req = pb.LoadRequest(model=model, tokens=_tokens(token_ids))
        self._n = streams
        self.streams = _Streams()
        self._calls: list[grpc.Call] = []
        self.headers_read = 0

    def start(self) -> None:
        for _ in range(self._n):
            call = self._stub.Load(self._req, metadata=self._md)
            try:
                next(call)  # the header; the chunks are never read
                self.headers_read += 1
            except grpc.RpcError as e:
                self.streams.ended(e)
                continue
            self._calls.append(call)

    def outcome(self) -> dict[str, object]:
        return {"headers_read": self.headers_read}

    def drain(self) -> list[str]:
        """Read every held stream to its end (a cancelled stream's status waits behind the data
        the client never read); the codes they ended with."""
        codes = []
        for c in self._calls:
            try:
                for _ in c:
                    pass
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)
        return codes

    def stop(self) -> None:
        for c in self._calls:
            c.cancel()
        self._channel.close()


class RunnerFlood(Abuser):
    """Attaches runners until refused; each then sends JobResults for made-up jobs declaring
    `declared_bytes` each."""

    name = "runner_flood"

    def __init__(self, address: str, token: str | None, model: str, layout_id: bytes, runners: int,
                 bogus_results: int = 4, declared_bytes: int = 256 << 20) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.RunnersStub(self._channel)
        self._md = _metadata(token)
        self._hello = pb.RunnerMessage(hello=pb.RunnerHello(
            model=model, layout_id=layout_id, device="cpu", max_concurrent_jobs=1, max_batch=1, name="flood"))
        self._n = runners
        self._bogus = bogus_results
        self._declared = declared_bytes
        self._release = threading.Event()
        self.attached = 0
        self.refused: list[str] = []
        self.ended: list[str] = []
        self._calls: list[grpc.Call] = []

    def _messages(self, with_bogus: bool) -> Iterator[pb.RunnerMessage]:
        yield self._hello
        if with_bogus:
            for job_id in range(10_000, 10_000 + self._bogus):
                yield pb.RunnerMessage(result=pb.JobResult(
                    job_id=job_id, offset=0, data=b"x", total_bytes=self._declared, last=False))
        self._release.wait()

    def start(self, with_bogus: bool = False) -> None:
        for _ in range(self._n):
            call = self._stub.Attach(self._messages(with_bogus), metadata=self._md)
            try:
                first = next(call)
            except grpc.RpcError as e:
                self.refused.append(f"{e.code().name}: {e.details()}")
                continue
            if first.WhichOneof("kind") == "attached":
                self.attached += 1
            self._calls.append(call)

    def wait_ended(self, timeout_seconds: float) -> bool:
        end = time.monotonic() + timeout_seconds
        while time.monotonic() < end:
            if all(not c.is_active() for c in self._calls):
                self.ended = [f"{c.code().name}: {c.details()}" for c in self._calls]
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        self._release.set()
        for c in self._calls:
            c.cancel()
        self._channel.close()

    def outcome(self) -> dict[str, object]:
        return {"attached": self.attached, "refused": len(self.refused)}


@dataclass
class VictimReport:
    calls: int
    errors: int
    error_codes: list[str]
    latencies_ms: list[float]  # the Lookups' only: the figure is the victim's Lookup latency
    stats_latencies_ms: list[float]  # the Stats calls' (every tenth), apart: quicker, they lowered the p99

    def p99_ms(self) -> float:
        """The p99 of the Lookups."""
        return _p99(self.latencies_ms)

    def stats_p99_ms(self) -> float:
        return _p99(self.stats_latencies_ms)


def _p99(latencies_ms: list[float]) -> float:
    return float(np.percentile(latencies_ms, 99)) if latencies_ms else float("nan")


class Victim:
    """Another tenant calling Lookup (and Stats every tenth call) in a loop until stopped."""

    def __init__(self, address: str, token: str | None, model: str, token_ids: np.ndarray,
                 timeout_seconds: float = 10.0, pause_seconds: float = 0.0) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.KVCacheStub(self._channel)
        self._md = _metadata(token)
        self._req = pb.LookupRequest(model=model, tokens=_tokens(token_ids))
        self._timeout = timeout_seconds
        self._pause = pause_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lat: list[float] = []
        self._stats_lat: list[float] = []
        self._errors: list[str] = []

    def call_once(self, i: int = 1) -> None:
        t0 = time.perf_counter()
        try:
            if i % 10 == 0:
                self._stub.Stats(pb.StatsRequest(), metadata=self._md, timeout=self._timeout)
                self._stats_lat.append((time.perf_counter() - t0) * 1e3)
            else:
                self._stub.Lookup(self._req, metadata=self._md, timeout=self._timeout)
                self._lat.append((time.perf_counter() - t0) * 1e3)
        except grpc.RpcError as e:
            self._errors.append(f"{e.code().name}: {e.details()}")

    def run_for(self, calls: int) -> VictimReport:
        for i in range(1, calls + 1):
            self.call_once(i)
            if self._pause:
                time.sleep(self._pause)
        return self.report()

    def start(self) -> None:
        self._stop.clear()

        def loop() -> None:
            i = 0
            while not self._stop.is_set():
                i += 1
                self.call_once(i)
                if self._pause:
                    self._stop.wait(self._pause)

        self._thread = threading.Thread(target=loop, name="victim", daemon=True)
        self._thread.start()

    def stop(self) -> VictimReport:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        return self.report()

    def report(self) -> VictimReport:
        return VictimReport(len(self._lat) + len(self._stats_lat) + len(self._errors), len(self._errors),
                            list(self._errors), list(self._lat), list(self._stats_lat))

    def reset(self) -> None:
        self._lat.clear()
        self._stats_lat.clear()
        self._errors.clear()

    def close(self) -> None:
        self._channel.close()


class BodyLessCalls(Abuser):
    """Calls without credentials that never send their request message: Lookups, health checks and
    reflection streams, `per_method` of each over `channels` connections, each opened again a
    second after it ends (refused or cut), as an attacker would. gRPC held a call slot for every
    one of them before any code of kvstore's ran, until its own limit refused every tenant."""

    name = "body_less_calls"
    METHODS = ("/kvstore.v1.KVCache/Lookup", "/grpc.health.v1.Health/Check",
               "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    REOPEN_SECONDS = 1.0

    def __init__(self, address: str, per_method: int = 100, channels: int = 4) -> None:
        self._channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                          for _ in range(channels)]
        self._per_method = per_method
        self._release = threading.Event()
        self._lock = threading.Lock()
        self._calls: list[grpc.Future] = []
        self.codes: dict[str, int] = {}
        self.opened = 0

    def _nothing(self) -> Iterator[bytes]:
        self._release.wait()
        return
        yield  # a generator

    def _open(self, method: str, i: int) -> None:
        ch = self._channels[i % len(self._channels)]
        call: grpc.Future
        if method.endswith("ServerReflectionInfo"):
            call = ch.stream_stream(method)(self._nothing())
        else:
            call = ch.stream_unary(method).future(self._nothing())
        with self._lock:
            self._calls.append(call)
            self.opened += 1
        call.add_done_callback(lambda c: self._ended(c, method, i))

    def _ended(self, call: grpc.Future, method: str, i: int) -> None:
        code = call.code().name
        with self._lock:
            self.codes[code] = self.codes.get(code, 0) + 1
        if not self._release.is_set():  # not on gRPC's callback thread, which must not wait
            again = threading.Timer(self.REOPEN_SECONDS, self._open_unless_stopped, (method, i))
            again.daemon = True
            again.start()

    def _open_unless_stopped(self, method: str, i: int) -> None:
        if not self._release.is_set():
            with contextlib.suppress(ValueError):  # its channel closed meanwhile: stopped
                self._open(method, i)

    def start(self) -> None:
        for method in self.METHODS:
            for i in range(self._per_method):
                self._open(method, i)

    def stop(self) -> None:
        self._release.set()
        with self._lock:
            calls = list(self._calls)
        for c in calls:
            c.cancel()
        for ch in self._channels:
            ch.close()

    def ended_with(self, code: str) -> int:
        """How many of its calls ended with status `code` (a name: "UNAUTHENTICATED")."""
        with self._lock:
            return self.codes.get(code, 0)

    def outcome(self) -> dict[str, object]:
        with self._lock:
            return {"opened": self.opened, "ended_codes": dict(self.codes)}
