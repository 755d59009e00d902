"""A span named by the other side is checked against the segment before any byte is touched."""

from __future__ import annotations

from kvstore.errors import InvalidInput


def check_span(offset: int, length: int, segment_bytes: int, what: str = "span") -> None:
    """Raise InvalidInput unless [offset, offset + length) lies inside a segment of `segment_bytes`."""
    if offset < 0 or length < 0:
        raise InvalidInput(f"{what} has a negative offset or length ({offset}, {length})")
    if length == 0:
        raise InvalidInput(f"{what} is empty")
    if offset + length > segment_bytes:
        raise InvalidInput(f"{what} [{offset}, {offset + length}) runs past the end of its "
                           f"{segment_bytes}-byte segment")
