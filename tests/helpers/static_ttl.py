"""A TtlPolicy with fixed answers that a test can change, for the local-pool tests."""

from __future__ import annotations


class StaticTtl:
    """A TtlPolicy with fixed answers (seconds), changeable by the test."""

    def __init__(self, write_seconds: float, read_seconds: float | None = None) -> None:
        self.write_seconds = write_seconds
        self.read_seconds = read_seconds

    def ttl_for_write(self, tenant: str, nbytes: int, now: float) -> float:
        return self.write_seconds

    def ttl_on_read(self, tenant: str, nbytes: int, now: float) -> float | None:
        return self.read_seconds

    def observe_return(self, tenant: str, gap_seconds: float) -> None:
        pass

    def describe(self) -> dict[str, object]:
        return {"kind": "static", "ttl_seconds": self.write_seconds}
