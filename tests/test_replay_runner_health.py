"""Which attached runner gets a replay job, through the real service: runners that speak
`Runners.Attach` (the test's fakes) answer expired Resumes' jobs, one of them hung (it never
answers) or failing (it answers every job with an error). Equal runners take turns; a runner whose
job timed out or failed is passed over while a healthy one is attached, a failed job is tried once
on another runner, and a runner that fails `MAX_STRIKES` jobs in a row is detached. No test asserts
on speed: the hung runner costs one Resume its deadline, which is what the test counts."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import pytest

from kvstore.v1 import kvstore_pb2 as pb
from replay.registry import MAX_STRIKES
from tests.test_replay_coordinator import NAME, wait_for
from tests.test_replay_service import Rig, _expired_boundary, config, make_rig  # noqa: F401 (a fixture)
from tests.test_service_runners import FakeRunner


def _runner(rig: Rig, replay: Callable[[pb.ReplayJob, list[bytes]], bytes | str]) -> FakeRunner:
    r = FakeRunner(grpc.insecure_channel(rig.svc.address), NAME, rig.app.layouts()[NAME].layout_id, replay).start()
    assert r.attached.wait(10) and r.runner_id
    return r


def _snapshot(rig: Rig) -> Callable[[pb.ReplayJob, list[bytes]], bytes]:
    """A healthy runner's answer: a snapshot of the right size (the service checks only that)."""
    size = rig.svc.snapshot_bytes(NAME)
    return lambda job, chunks: bytes(size)


@pytest.mark.parametrize("fault", ["hung", "failing"])
def test_a_hung_or_failing_runner_gets_one_job_and_the_healthy_one_the_rest(
        make_rig: Callable[..., Rig], fault: str) -> None:  # noqa: F811
    rig = make_rig(config(replay={"runner": "attached"}))
    prompts = [_expired_boundary(rig, 70 + 3 * i) for i in range(4)]
    hold = threading.Event()

    def bad(job: pb.ReplayJob, chunks: list[bytes]) -> str:
        if fault == "hung":
            hold.wait(60)  # a device that never comes back (until the test ends)
        return "CUDA error: device lost"

    sick = _runner(rig, bad)  # attached first: it gets the first job
    well = _runner(rig, _snapshot(rig))
    try:
        got = [rig.client.resume(NAME, p, timeout_seconds=2.0) for p in prompts]
    finally:
        hold.set()
    statuses = [r.replay_status for r in got]
    # The hung runner's job times out at the first Resume's deadline; the failing one's job is
    # tried again on the healthy runner. Either way the sick runner gets no second job.
    assert statuses == (["timeout"] if fault == "hung" else ["replayed"]) + ["replayed"] * 3
    assert len(sick.jobs) == 1
    assert len(well.jobs) == (3 if fault == "hung" else 4)
    assert len(rig.app.runners.runners()) == 2  # one strike is not a detach
    sick.close()
    well.close()


def test_equal_runners_take_turns(make_rig: Callable[..., Rig]) -> None:  # noqa: F811
    rig = make_rig(config(replay={"runner": "attached"}))
    prompts = [_expired_boundary(rig, 90 + 3 * i) for i in range(4)]
    first, second = _runner(rig, _snapshot(rig)), _runner(rig, _snapshot(rig))
    assert [rig.client.resume(NAME, p).replay_status for p in prompts] == ["replayed"] * 4
    # Each was idle when the next job came: ties go to the runner given a job least recently.
    assert (len(first.jobs), len(second.jobs)) == (2, 2)
    first.close()
    second.close()


def test_a_runner_failing_jobs_in_a_row_is_detached_and_one_that_recovers_is_not(
        make_rig: Callable[..., Rig]) -> None:  # noqa: F811
    rig = make_rig(config(replay={"runner": "attached"}))
    prompts = [_expired_boundary(rig, 110 + 3 * i) for i in range(2 * MAX_STRIKES + 1)]
    size = rig.svc.snapshot_bytes(NAME)
    # Fails all but its MAX_STRIKES-th job: strikes in a row, then a snapshot clears them.
    answers = ["out of memory"] * (MAX_STRIKES - 1) + [bytes(size)] + ["out of memory"] * MAX_STRIKES
    runner = _runner(rig, lambda job, chunks: answers[len(runner.jobs) - 1])
    statuses = [rig.client.resume(NAME, p).replay_status for p in prompts[: 2 * MAX_STRIKES - 1]]
    assert statuses == ["failed"] * (MAX_STRIKES - 1) + ["replayed"] + ["failed"] * (MAX_STRIKES - 1)
    assert len(rig.app.runners.runners()) == 1 and rig.app.runners.misbehaved_total == 0
    # Its MAX_STRIKES-th failure in a row: detached, counted, its stream ended (cleanly: it may
    # come back), and the next expired Resume finds no runner instead of a failing one.
    assert rig.client.resume(NAME, prompts[-2]).replay_status == "failed"
    wait_for(lambda: not rig.app.runners.runners())
    assert rig.app.runners.misbehaved_total == 1
    runner.thread.join(10)
    assert runner.error is None
    assert rig.client.resume(NAME, prompts[-1]).replay_status == "no-runner"
    assert len(runner.jobs) == 2 * MAX_STRIKES
