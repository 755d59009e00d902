"""The generated API code is what the .proto says, the dependency pins match it, the hand-encoded
chunk pieces are byte-for-byte what the protobuf library would produce, and a Lookup answer with
hand-packed tier labels parses to the message the library would build."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.messages import (
    TIER_TO_PB,
    chunk_piece_frame,
    chunk_piece_head,
    encode_chunk_piece,
    encode_lookup_request,
    encode_lookup_response,
    job_chunks_frame,
    tiers_from_pb,
)

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")
# Lines that name the generator's version: a newer grpcio-tools changes them and nothing else that
# matters, and the pin test below checks the versions themselves.
VERSION_LINE = re.compile(r"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|\s+\d+,)$", re.M)


def _normalized(text: str) -> str:
    return VERSION_LINE.sub("<version>", text)


def _load_gen_script() -> object:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_code_is_regenerated_from_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    gen = _load_gen_script()
    gen.generate(tmp_path)  # type: ignore[attr-defined]
    for name in GENERATED:
        fresh = (tmp_path / "kvstore" / "v1" / name).read_text()
        checked_in = (ROOT / "kvstore" / "v1" / name).read_text()
        assert _normalized(fresh) == _normalized(checked_in), (
            f"kvstore/v1/{name} is stale: run `python scripts/gen_proto.py` and commit the result")


def _min_version(spec: str, package: str) -> tuple[int, ...]:
    m = re.fullmatch(rf"{package}\s*>=\s*([0-9.]+)(,.*)?", spec.strip())
    assert m, f"pyproject pins {package} as {spec!r}; expected '{package}>=X.Y.Z'"
    return tuple(int(x) for x in m.group(1).split("."))


def test_dependency_pins_admit_only_runtimes_the_generated_code_accepts() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    by_name = {re.split(r"[<>=!~ ]", d, maxsplit=1)[0]: d for d in deps}
    pb_src = (ROOT / "kvstore" / "v1" / "kvstore_pb2.py").read_text()
    m = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb_src)
    assert m, "cannot find the protobuf gencode version in kvstore_pb2.py"
    gencode = tuple(int(x) for x in m.groups())
    assert _min_version(by_name["protobuf"], "protobuf") >= gencode, (
        f"generated code needs protobuf >= {'.'.join(map(str, gencode))}; pyproject says {by_name['protobuf']}")
    assert f"<{gencode[0] + 1}" in by_name["protobuf"], "the protobuf major version must be capped"
    grpc_src = (ROOT / "kvstore" / "v1" / "kvstore_pb2_grpc.py").read_text()
    g = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_src)
    assert g
    needed = tuple(int(x) for x in g.group(1).split("."))
    assert _min_version(by_name["grpcio"], "grpcio") >= needed, (
        f"generated code needs grpcio >= {g.group(1)}; pyproject says {by_name['grpcio']}")


def test_services_and_methods_are_what_clients_expect() -> None:
    kv = pb.DESCRIPTOR.services_by_name["KVCache"]
    assert pb.DESCRIPTOR.package == "kvstore.v1"
    shape = {m.name: (m.client_streaming, m.server_streaming) for m in kv.methods}
    assert shape == {
        "Lookup": (False, False), "Store": (True, False), "Load": (False, True), "StoreLocal": (True, False),
        "LoadLocal": (False, True), "Resume": (False, True), "Stats": (False, False), "RegisterModel": (False, False),
    }
    attach = pb.DESCRIPTOR.services_by_name["Runners"].methods_by_name["Attach"]
    assert attach.client_streaming and attach.server_streaming
    # No request carries a tenant: the server takes it from authentication only.
    for msg in pb.DESCRIPTOR.message_types_by_name.values():
        assert "tenant" not in msg.fields_by_name or msg.name == "StatsResponse", msg.name


def test_generated_package_imports_inside_kvstore() -> None:
    assert "kvstore.v1.kvstore_pb2" in sys.modules
    from kvstore.v1 import kvstore_pb2_grpc

    assert hasattr(kvstore_pb2_grpc, "KVCacheStub")


@settings(max_examples=60, deadline=None)
@given(
    first=st.integers(0, 2**32 - 1),
    offset=st.integers(0, 2**40),
    tiers=st.lists(st.sampled_from([0, 1, 2, 3]), max_size=40),
    data=st.binary(max_size=3000),
    resume=st.booleans(),
)
def test_hand_encoded_pieces_equal_the_library_encoding(
    first: int, offset: int, tiers: list[int], data: bytes, resume: bool
) -> None:
    wire = encode_chunk_piece(first, offset, tiers, data)
    piece = pb.ChunkPiece(first_chunk=first, offset=offset, data=data, tiers=cast(Any, tiers))
    cls = pb.ResumeResponse if resume else pb.LoadResponse
    expected = cls(chunks=piece)
    assert cls.FromString(wire) == expected


@settings(max_examples=40, deadline=None)
@given(first=st.integers(0, 2**32 - 1), tiers=st.lists(st.sampled_from([1, 2, 3]), max_size=40),
       data=st.binary(max_size=3000))
def test_a_piece_head_and_its_payload_are_the_library_encoding(first: int, tiers: list[int], data: bytes) -> None:
    wire = chunk_piece_head(first, bytes(tiers), len(data)) + data
    expected = pb.LoadResponse(chunks=pb.ChunkPiece(first_chunk=first, data=data, tiers=cast(Any, tiers)))
    assert pb.LoadResponse.FromString(wire) == expected


@settings(max_examples=60, deadline=None)
@given(job_id=st.integers(0, 2**64 - 1), first=st.integers(0, 2**32 - 1), offset=st.integers(0, 2**40),
       data=st.binary(max_size=3000), reuse=st.booleans())
def test_a_hand_laid_job_chunks_command_parses_as_the_library_builds_it(
        job_id: int, first: int, offset: int, data: bytes, reuse: bool) -> None:
    into = bytearray(b"\xff" * 4000) if reuse else None  # a buffer a longer message used before
    frame = job_chunks_frame(job_id, first, offset, len(data), into=into)
    frame.buf[frame.payload_start : frame.size] = data
    expected = pb.RunnerCommand(chunks=pb.JobChunks(job_id=job_id, chunks=pb.ChunkPiece(
        first_chunk=first, offset=offset, data=data)))
    assert pb.RunnerCommand.FromString(frame.finish()) == expected


def test_a_reused_frame_buffer_starts_with_cleared_labels() -> None:
    big = chunk_piece_frame(300, 0, 3, 30)
    big.buf[big.tiers_start : big.tiers_start + 3] = bytes([pb.TIER_LMDB] * 3)
    small = chunk_piece_frame(2, 0, 2, 8, into=big.buf)
    assert small.buf is big.buf and small.size < len(big.buf)
    small.buf[small.payload_start : small.size] = b"abcdefgh"
    msg = pb.LoadResponse.FromString(small.finish())
    assert (msg.chunks.first_chunk, list(msg.chunks.tiers), msg.chunks.data) == (2, [0, 0], b"abcdefgh")
    assert chunk_piece_frame(2, 0, 2, 64, into=bytearray(4)).size == len(chunk_piece_frame(2, 0, 2, 64).buf)


def test_frame_labels_are_filled_in_place() -> None:
    frame = chunk_piece_frame(3, 0, 2, 8)
    frame.buf[frame.tiers_start : frame.tiers_start + 2] = bytes([pb.TIER_DRAM, pb.TIER_LMDB])
    frame.buf[frame.payload_start :] = b"abcdefgh"
    msg = pb.LoadResponse.FromString(frame.finish())
    assert (msg.chunks.first_chunk, list(msg.chunks.tiers), msg.chunks.data) == (
        3, [pb.TIER_DRAM, pb.TIER_LMDB], b"abcdefgh")


@settings(max_examples=60, deadline=None)
@given(tiers=st.lists(st.sampled_from(["device", "dram", "lmdb"]), max_size=300),
       hit=st.integers(0, 2**31 - 1), mode=st.sampled_from(["", "bounded", "exact"]))
def test_a_lookup_response_with_hand_packed_tiers_parses_as_the_library_builds_it(
    tiers: list[str], hit: int, mode: str,
) -> None:
    bills = pb.Bills(prompt_tokens=hit, tiers=[pb.TierBill(tier=pb.TIER_DRAM, hit_chunks=len(tiers))])
    fields: dict[str, Any] = {"hit_tokens": hit, "hit_chunks": len(tiers), "bills": bills, "replay_mode": mode}
    wire = encode_lookup_response(pb.LookupResponse(**fields), tiers)
    expected = pb.LookupResponse(chunk_tiers=[TIER_TO_PB[t] for t in tiers], **fields)
    assert pb.LookupResponse.FromString(wire) == expected


@settings(max_examples=60, deadline=None)
@given(model=st.text(max_size=40), mode=st.sampled_from(["", "bounded", "exact", "off"]),
       ids=st.lists(st.integers(0, 2**32 - 1), max_size=300), salt=st.text(max_size=8),
       session=st.text(max_size=20), hold=st.integers(0, 2**32 - 1))
def test_a_hand_encoded_lookup_request_parses_as_the_library_builds_it(
    model: str, mode: str, ids: list[int], salt: str, session: str, hold: int,
) -> None:
    u32le = np.asarray(ids, dtype="<u4").tobytes()
    wire = encode_lookup_request(model, mode, u32le, salt, session, hold)
    expected = pb.LookupRequest(model=model, replay_mode=mode, tokens={"u32le": u32le}, cache_salt=salt,
                                shm_session=session, hold_chunks=hold)
    parsed = pb.LookupRequest.FromString(wire)
    assert parsed == expected and parsed.HasField("tokens") and wire == expected.SerializeToString()
    view = np.asarray(ids, dtype="<u4").data.cast("B")  # the client passes a view of its token array
    assert encode_lookup_request(model, mode, view, salt, session, hold) == wire


@given(tiers=st.lists(st.sampled_from([0, 1, 2, 3, 7, 300]), max_size=60))
def test_tier_enums_read_back_as_names_with_unknown_ones_empty(tiers: list[int]) -> None:
    names = {pb.TIER_DEVICE: "device", pb.TIER_DRAM: "dram", pb.TIER_LMDB: "lmdb"}
    msg = pb.LookupResponse(chunk_tiers=cast(Any, tiers))
    assert tiers_from_pb(msg.chunk_tiers) == tuple(names.get(t, "") for t in tiers)
