"""GPU memory shared between processes on one host: the CUDA counterpart of `segments.py`.

`DeviceSegment` is an allocation of its own (`cudaMalloc`, through cupy) whose IPC handle another
process of the same host opens (`OpenedSegment`) to read it where it lies, device to
device, with no host round trip. An allocation of its own, not a slice of torch's caching
allocator, because a handle opens a whole allocation: a tenant's part of the device tier must
not share one with anything else. CUDA cannot map such memory read-only: an importer could write
it (see docs/architecture.md §11).

cupy is the `cuda` extra (`pip install kvstore[cuda]`); without it, or without a GPU, nothing here
is offered and `cuda_ipc_unavailable()` says why.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class _CudaMemory:
    """A raw device pointer in the form torch.as_tensor takes (the CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


@functools.cache
def _runtime() -> tuple[Any, str]:
    """(cupy's CUDA runtime, "") or (None, why not). cupy is imported the first time it is asked
    for, never at start."""
    if not torch.cuda.is_available():
        return None, "no CUDA device is visible to torch"
    try:
        import cupy  # the `cuda` extra
        return cupy.cuda.runtime, ""
    except Exception as e:
        return None, f"cupy cannot be imported ({type(e).__name__}: {e}); install kvstore[cuda]"


def cuda_ipc_unavailable() -> str:
    """"" where GPU memory can be shared between processes here; else why not."""
    return _runtime()[1]


def cupy_runtime() -> Any | None:
    """cupy's CUDA runtime where there is a GPU and cupy, else None."""
    return _runtime()[0]


class DeviceSegment:
    """`nbytes` of GPU memory in an allocation of its own, as a 1-D uint8 tensor, and its IPC handle."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        runtime, why = _runtime()
        if runtime is None:
            raise OSError(why)
        self.nbytes = nbytes
        self.device = torch.device("cuda", device.index or 0)
        with torch.cuda.device(self.device):
            self._ptr: int | None = int(runtime.malloc(max(1, nbytes)))
            try:
                self.handle = bytes(runtime.ipcGetMemHandle(self._ptr))
                self.tensor = torch.as_tensor(_CudaMemory(self._ptr, nbytes), device=self.device)
            except BaseException:
                runtime.free(self._ptr)
                raise

    def close(self) -> None:
        if self._ptr is None:
            return
        self.tensor = torch.empty(0, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)  # no copy may still be reading it
        _runtime()[0].free(self._ptr)
        self._ptr = None


class OpenedSegment:
    """Another process's `DeviceSegment`, opened from its handle, as a 1-D uint8 tensor."""

    def __init__(self, handle: bytes, nbytes: int, device: torch.device | None = None) -> None:
        runtime, why = _runtime()
        if runtime is None:
            raise OSError(why)
        if len(handle) != HANDLE_BYTES or nbytes <= 0:
            raise ValueError(f"a CUDA IPC handle is {HANDLE_BYTES} bytes and a segment not empty "
                             f"(got {len(handle)} bytes, {nbytes})")
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(self.device):
            self._ptr: int | None = int(runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess))
        self.nbytes = nbytes
        self.tensor = torch.as_tensor(_CudaMemory(self._ptr, nbytes), device=self.device)

    def close(self) -> None:
        if self._ptr is None:
            return
        self.tensor = torch.empty(0, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)
        _runtime()[0].ipcCloseMemHandle(self._ptr)
        self._ptr = None
