"""The device tier's GPU memory shared with same-host clients by CUDA IPC handles.

`kvstore serve` runs as a process of its own (a process cannot open its own IPC handles) with its
device tier on the GPU, split between two tenants; this process is the engine: it stores chunks,
which land in the device tier, and loads them into a tensor on the same GPU, device to device.
Needs a GPU and cupy; on a machine without them the same-host tests run the host paths, and the
hello's `cuda` flag is checked in test_service_shm.py."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.client import KvstoreClient
from kvstore.dataplane.cuda_ipc import cuda_ipc_unavailable
from kvstore.errors import InvalidInput
from tests.fixtures.service import CHUNK, V41, ServiceProcess, base_table, payloads, spawn_service, tokens

pytestmark = pytest.mark.skipif(bool(cuda_ipc_unavailable()), reason=f"needs CUDA and cupy: {cuda_ipc_unavailable()}")

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"
V41_CHUNK = 890 * CHUNK  # bytes of a 16-token V4.1 chunk


@pytest.fixture
def gpu_service() -> Iterator[tuple[ServiceProcess, Path]]:
    d = Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))  # a Unix socket path must be short
    table = base_table(
        store={"device": "cuda", "device_capacity_bytes": 8 << 20, "dram_capacity_bytes": 8 << 20},
        service={"unix_socket_path": str(d / "kv.sock"), "shm_load_segment_bytes": 4 << 20,
                 "shm_store_segment_bytes": 4 << 20, "models": [V41], "max_message_bytes": 1 << 20},
        tenants={"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}},
    )
    svc = spawn_service(d, table)
    yield svc, d / "kv.sock"
    svc.terminate()
    shutil.rmtree(d, ignore_errors=True)


def test_a_load_into_a_gpu_tensor_reads_the_device_tier_device_to_device(
        gpu_service: tuple[ServiceProcess, Path]) -> None:
    _, sock = gpu_service
    prompt = tokens(21, CHUNK * 12)
    chunks = payloads(22, 12, V41_CHUNK)
    with KvstoreClient(f"unix://{sock}", token=ALICE, timeout_seconds=20.0) as alice, \
            KvstoreClient(f"unix://{sock}", token=BOB, timeout_seconds=20.0) as bob:
        alice.store(V41, prompt, chunks)
        out = torch.zeros(12 * V41_CHUNK + 100, dtype=torch.uint8, device="cuda")
        got = alice.load_into(V41, prompt, out)
        assert got.loaded_chunks == 12 and set(got.chunk_tiers) == {"device"}
        assert bytes(out[: 12 * V41_CHUNK].cpu().numpy()) == b"".join(chunks)
        assert not out[12 * V41_CHUNK :].any()  # nothing past the chunks is written
        shm = alice._shm
        assert shm is not None and set(shm.device_arenas) == {"device"}
        stats = alice.stats().data_plane
        assert stats is not None and stats.sessions[0].in_place_bytes >= 12 * V41_CHUNK
        # The same chunks into host memory and as shared views: copied down from the GPU.
        host = bytearray(12 * V41_CHUNK)
        assert alice.load_into(V41, prompt, host).loaded_chunks == 12 and bytes(host) == b"".join(chunks)
        with alice.load_shared(V41, prompt) as shared:
            assert [bytes(v) for v in shared.chunks] == chunks and shared.still_held()
        # Bob opens his own part of the GPU's memory, never Alice's, and finds nothing of hers.
        assert bob.load(V41, prompt).chunks == []
        assert bob._shm is not None and set(bob._shm.device_arenas) == {"device"}
        assert bob._shm.device_arenas["device"].tensor.data_ptr() != shm.device_arenas["device"].tensor.data_ptr()
        assert b"".join(chunks)[:64] not in bytes(bob._shm.device_arenas["device"].tensor.cpu().numpy())
        # A forged offset past Alice's part is refused before anything is read.
        seg = shm.device_arenas["device"]
        with pytest.raises(InvalidInput, match="device tier"):
            shm.copy_chunks_out("device", [seg.nbytes - V41_CHUNK + 1], V41_CHUNK,
                                torch.empty(V41_CHUNK, dtype=torch.uint8, device="cuda"), time.monotonic() + 60)


def test_a_client_without_gpu_memory_loads_the_same_bytes_through_host_memory(
        gpu_service: tuple[ServiceProcess, Path]) -> None:
    _, sock = gpu_service
    prompt = tokens(31, CHUNK * 6)
    chunks = payloads(32, 6, V41_CHUNK)
    with KvstoreClient(f"unix://{sock}", token=ALICE, timeout_seconds=20.0) as alice:
        alice.store(V41, prompt, chunks)
        from kvstore.dataplane.peer import ShmPath

        plain = ShmPath.open(str(sock), ALICE, cuda=False)  # the service offers it no GPU memory
        try:
            assert plain.device_arenas == {}
        finally:
            plain.close()
        out = torch.zeros(6 * V41_CHUNK, dtype=torch.uint8, device="cuda")
        assert alice.load_into(V41, prompt, out).loaded_chunks == 6
        assert np.array_equal(out.cpu().numpy(), np.frombuffer(b"".join(chunks), np.uint8))


def test_load_into_a_gpu_tensor_over_tcp_streams_through_host_memory(
        gpu_service: tuple[ServiceProcess, Path]) -> None:
    svc, _ = gpu_service
    prompt = tokens(41, CHUNK * 5)
    chunks = payloads(42, 5, V41_CHUNK)
    with KvstoreClient(svc.address, token=ALICE, timeout_seconds=20.0) as alice:
        alice.store(V41, prompt, chunks)
        out = torch.zeros(3 * V41_CHUNK, dtype=torch.uint8, device="cuda")  # room for three
        got = alice.load_into(V41, prompt, out)
        assert got.loaded_chunks == 3 and bytes(out.cpu().numpy()) == b"".join(chunks[:3])
        with pytest.raises(InvalidInput, match="contiguous"):
            alice.load_into(V41, prompt, torch.zeros(2, V41_CHUNK, dtype=torch.uint8, device="cuda").t())




def test_a_client_whose_handle_does_not_open_gets_a_session_without_gpu_memory(
        gpu_service: tuple[ServiceProcess, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.dataplane import cuda_ipc
    from kvstore.dataplane.peer import ShmPath

    _, sock = gpu_service

    def refuse(self: object, *args: object, **kwargs: object) -> None:
        raise RuntimeError("injected: cudaIpcOpenMemHandle failed")

    monkeypatch.setattr(cuda_ipc.OpenedSegment, "__init__", refuse)
    shm = ShmPath.open(str(sock), ALICE)  # asks for GPU memory (this process has torch, a GPU and cupy)
    try:
        assert shm.device_arenas == {} and "dram" in shm.arena_views
    finally:
        shm.close()
