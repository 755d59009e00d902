"""The reader of requests that carry token ids (Lookup, Load, LoadLocal, Resume) gives the fields the
protobuf library parses, with the u32le token bytes as a view into the received message, and
refuses exactly what the library refuses."""

from __future__ import annotations

import tracemalloc
from typing import Any, cast

import numpy as np
import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidInput
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.messages import tokens_from_proto
from kvstore.wire.tokens_in_place import WithTokens, tokens_field, tokens_in_place

REQUESTS: list[type[Message]] = [pb.LookupRequest, pb.LoadRequest, pb.LoadLocalRequest, pb.ResumeRequest]
decoders = {cls: tokens_in_place(cls) for cls in REQUESTS}

text_st = st.text(max_size=12)
tokens_st = st.one_of(
    st.builds(lambda b: pb.Tokens(u32le=b), st.binary(max_size=64)),
    st.builds(lambda ids: pb.Tokens(ids=cast(Any, ids)), st.lists(st.integers(0, 2**32 - 1), max_size=8)),
    st.builds(lambda b, ids: pb.Tokens(u32le=b, ids=cast(Any, ids)), st.binary(min_size=1, max_size=16),
              st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4)),
    st.just(pb.Tokens()),
)


@st.composite
def request_bytes(draw: st.DrawFn) -> tuple[type[Message], bytes]:
    """A request of one of the four kinds, serialized, possibly several concatenated (the wire's
    way of merging) and with unknown fields between them."""
    cls = draw(st.sampled_from(REQUESTS))
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        msg = cls(model=draw(text_st), tokens=draw(tokens_st))
        if draw(st.booleans()):
            msg.cache_salt = draw(text_st)  # type: ignore[attr-defined]
        parts.append(msg.SerializeToString())
        if draw(st.booleans()):
            parts.append(b"\xf8\x07\x05" + b"\xfa\x07\x02hi")  # unknown fields 127 (varint) and 127 (bytes)
    return cls, b"".join(parts)


def same_as_library(cls: type[Message], wire: bytes) -> None:
    lib = cls.FromString(wire)
    got = decoders[cls](wire)
    assert isinstance(got, WithTokens)
    assert bytes(got.u32le) == lib.tokens.u32le  # type: ignore[attr-defined]
    assert got.message.HasField("tokens") == lib.HasField("tokens")
    if lib.HasField("tokens"):
        lib.tokens.u32le = b""  # type: ignore[attr-defined]
    lib.DiscardUnknownFields()
    got.message.DiscardUnknownFields()
    assert got.message == lib


@settings(max_examples=200, deadline=None)
@given(req=request_bytes())
def test_a_request_reads_as_the_library_reads_it_and_its_token_bytes_are_not_copied(
    req: tuple[type[Message], bytes],
) -> None:
    cls, wire = req
    same_as_library(cls, wire)
    got = decoders[cls](wire)
    if len(got.u32le):
        assert got.u32le.obj is wire


@settings(max_examples=300, deadline=None)
@given(req=request_bytes(), cuts=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=3),
       trim=st.integers(0, 5))
def test_a_mutated_request_is_refused_exactly_when_the_library_refuses_it(
    req: tuple[type[Message], bytes], cuts: list[tuple[int, int]], trim: int,
) -> None:
    cls, wire = req
    raw = bytearray(wire[: max(0, len(wire) - trim)])
    for at, value in cuts:
        if raw:
            raw[at % len(raw)] = value
    data = bytes(raw)
    try:
        cls.FromString(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            decoders[cls](data)
        return
    same_as_library(cls, data)


def test_the_requests_with_tokens_are_exactly_the_four_read_in_place() -> None:
    with_tokens = {getattr(pb, m.input_type.name) for m in pb.DESCRIPTOR.services_by_name["KVCache"].methods
                   if tokens_field(getattr(pb, m.input_type.name)) is not None}
    assert with_tokens == set(REQUESTS)
    with pytest.raises(ValueError, match="no top-level tokens field"):
        tokens_in_place(pb.StatsRequest)


def test_a_long_prompt_is_read_without_a_copy_of_its_tokens() -> None:
    # 900K tokens: the library's parse and its read of the field each copied 3.6 MB, holding the
    # interpreter lock every other call waits for.
    ids = np.random.default_rng(7).integers(0, 100_000, 900_000, dtype="<u4")
    wire = pb.LookupRequest(model="m", tokens=pb.Tokens(u32le=ids.tobytes()), cache_salt="s").SerializeToString()
    decode = decoders[pb.LookupRequest]
    decode(wire)
    tracemalloc.start()
    try:
        got = decode(wire)
        tokens = tokens_from_proto(got.message.tokens, 1_000_000, got.u32le)  # type: ignore[attr-defined]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < ids.nbytes // 100, peak
    assert np.array_equal(tokens, ids) and tokens.base is not None
    assert got.message.model == "m" and got.message.cache_salt == "s"  # type: ignore[attr-defined]


def test_token_bytes_in_place_get_the_same_checks_as_the_librarys() -> None:
    with pytest.raises(InvalidInput, match="4 bytes per token"):
        tokens_from_proto(pb.Tokens(), 10, memoryview(b"12345"))
    with pytest.raises(InvalidInput, match=r"either tokens\.u32le or tokens\.ids"):
        tokens_from_proto(pb.Tokens(ids=[1]), 10, memoryview(bytes(4)))
    with pytest.raises(InvalidInput, match="exceed the service's limit of 1 tokens"):
        tokens_from_proto(pb.Tokens(), 1, memoryview(bytes(8)))
