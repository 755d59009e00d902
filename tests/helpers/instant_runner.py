"""A replay runner that answers every job at once with a snapshot of the right size: for tests of
what the coordinator and the service do with a replay's outcome, not of what a model computes."""

from __future__ import annotations

from replay.runner import JobHandle, ReplayJob, ReplayResult, resolved


class InstantRunner:
    name = "instant"

    def __init__(self, size: int) -> None:
        self.size = size  # the layout's local snapshot bytes

    def serves(self, model: str, tenant: str) -> bool:
        return True

    def submit(self, job: ReplayJob) -> JobHandle:
        return resolved(ReplayResult(bytes(self.size), "", self.name))

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        pass
