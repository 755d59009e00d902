"""What an attached runner says is the caller's text: its hello's model (checked like a KVCache
call's before it is looked up or quoted back), its device and its errors for jobs (bounded, and
quoted wherever they are logged, so that no runner can start a log line of the service's). Real
service on port 0, a runner's side of `Runners.Attach` over real gRPC, a real Resume that replays."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from kvstore.service.runners_servicer import RUNNER_ERROR_CHARS, _runner_error
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pbg
from tests.fixtures.service import TOY, Service, make_config

FORGED = "2026-01-01 00:00:00,000 WARNING kvstore.service: FORGED: tenant bob exceeded quota"


def _refusal(service: Service, model: str) -> grpc.RpcError:
    """The answer to a hello for `model` (with the right layout id) that is refused."""
    lay = service.app.layouts()[TOY].layout_id

    def hello() -> Iterator[pb.RunnerMessage]:
        yield pb.RunnerMessage(hello=pb.RunnerHello(model=model, layout_id=lay, max_concurrent_jobs=1))
        time.sleep(2)  # the refusal comes first

    with (grpc.insecure_channel(service.address, options=[("grpc.max_send_message_length", 1 << 20)]) as ch,
          pytest.raises(grpc.RpcError) as e):
        next(pbg.RunnersStub(ch).Attach(hello(), timeout=10))
    return e.value


@pytest.mark.parametrize(("model", "shown"), [
    ("M" * (100 << 10), "'" + "M" * 160 + "'..."),  # was RESOURCE_EXHAUSTED: the name overflowed the metadata
    ("M" * 129, "'" + "M" * 129 + "'"),
    ("x\n" + FORGED, repr("x\n" + FORGED)),  # came back with its newline
])
def test_a_hello_whose_model_is_no_valid_name_is_refused_as_invalid_argument(
        service: Service, model: str, shown: str) -> None:
    err = _refusal(service, model)
    said = err.details() or ""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, said[:200]
    assert said == f"runner model {shown} is not a valid model name (at most 128 printable characters)"
    assert "\n" not in said and not service.app.runners.runners()


def test_a_hello_for_a_model_not_served_quotes_its_name(service: Service) -> None:
    said = _refusal(service, "no-such-model").details() or ""
    assert said.startswith("runner model 'no-such-model' is not served here; served: ")


class ErringRunner:
    """A runner whose device says more than a device and which answers every job with `error`."""

    def __init__(self, channel: grpc.Channel, layout_id: bytes, device: str, error: str) -> None:
        self.out: queue.Queue[pb.RunnerMessage | None] = queue.Queue()
        self.out.put(pb.RunnerMessage(hello=pb.RunnerHello(
            model=TOY, layout_id=layout_id, device=device, max_concurrent_jobs=1, max_batch=1, name="r")))
        self.attached = threading.Event()
        self.jobs = 0
        self._error = error
        self.call = pbg.RunnersStub(channel).Attach(iter(self.out.get, None))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for cmd in self.call:
                kind = cmd.WhichOneof("kind")
                if kind == "attached":
                    self.attached.set()
                elif kind == "job":
                    self.jobs += 1
                    self.out.put(pb.RunnerMessage(result=pb.JobResult(job_id=cmd.job.job_id, last=True,
                                                                      error=self._error)))
        except grpc.RpcError:
            pass

    def stop(self) -> None:
        self.out.put(None)
        self.call.cancel()
        self.thread.join(10)


def test_a_runners_device_and_errors_cannot_start_a_log_line_nor_flood_the_log(
        make_service: Callable[..., Service], caplog: pytest.LogCaptureFixture) -> None:
    svc = make_service(make_config(replay={"runner": "attached"}))
    caplog.set_level(logging.INFO)
    error = "oops\n" + FORGED + "\n" + "E" * 100_000
    runner = ErringRunner(svc.client().channel, svc.app.layouts()[TOY].layout_id, "cpu\n" + FORGED, error)
    try:
        assert runner.attached.wait(10)
        client = svc.client()
        toks = np.arange(64, dtype=np.uint32)
        cb = client.lookup(TOY, toks).chunk_bytes
        client.store(TOY, toks, np.zeros(4 * cb, np.uint8).tobytes())
        got = client.resume(TOY, toks, timeout_seconds=10)
        assert got.case == "expired" and runner.jobs >= 1
        # The caller is told the replay failed, never the runner's text.
        assert "oops" not in str(got) and "FORGED" not in str(got)
    finally:
        runner.stop()
    messages = caplog.messages
    for m in messages:  # none as long as the error was, none with a line the runner began
        assert len(m) < 2 * RUNNER_ERROR_CHARS + 500, m[:200]
        assert "\n" not in m, m[:200]
    failed = [m for m in messages if m.startswith("replay failed on ")]
    kept = "oops\\n" + FORGED + "\\n" + "E" * (RUNNER_ERROR_CHARS - len(FORGED) - 6 - 2) + "..."
    assert len(failed) == 1 and failed[0].endswith(kept), failed[0][:400]
    attached = [m for m in messages if " attached: model " in m]
    assert len(attached) == 1 and f"on {('cpu' + chr(10) + FORGED)[:64]!r}, " in attached[0]


def test_a_runners_error_kept_is_bounded_after_its_escapes() -> None:
    # Escaped after the cut, 400 NULs grew to 1,203 characters ("\x00" each) and 400 tags to 3,003.
    for text in ("\x00" * 400, "\U000e0001" * 400, "ok" * 400):
        kept = _runner_error(text)
        assert len(kept) <= RUNNER_ERROR_CHARS + 3 and kept.endswith("...") and "\n" not in kept, len(kept)
    assert _runner_error("short\nerror") == "short\\nerror"
