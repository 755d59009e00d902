"""What a call sends, and the checks on what its caller passed, made before anything is sent: the
target, timeouts and TLS files, token ids packed as the wire's little-endian uint32, chunk counts
and other uint32 fields, the arguments that must be strings, a Store's payloads as one run of
bytes, a `load_into` destination as a writable byte view (or a GPU tensor), a snapshot as bytes, a
Load's and a RegisterModel's request.

What it does not know: channels, sessions or retries (sync_client.py), or what comes back
(replies.py).
"""

from __future__ import annotations

import array
import contextlib
import functools
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvstore.client.errors import InvalidArgumentError
from kvstore.config.fields import DAY_SECONDS
from kvstore.errors import InvalidInput
from kvstore.layout import EngineLayerGroup, EngineModel
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire.targets import target_problem
from kvstore.wire.tls_files import check_tls_ca, check_tls_client

U32_MAX = (1 << 32) - 1


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _chunk_count(name: str, value: object, method: str) -> int:
    """A request's chunk count or index (or another uint32 field): an integer in [0, 2**32), as its
    field holds (a negative one raised protobuf's bare ValueError, a larger one was cut short on
    the wire)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= value <= U32_MAX:
        raise InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be an integer from 0 to "
                                   f"{U32_MAX}, got {value!r}", method)
    return int(value)


def _check_target(target: object) -> str:
    """`target` as gRPC dials it, refused here where it never names a service
    (`kvstore.wire.targets`): gRPC failed every call as UNKNOWN for "", and dialled a port past
    65535 modulo 65536 (99999: 34463)."""
    if (problem := target_problem(target)) is not None:
        raise InvalidInput(f"target {problem}")
    return str(target)


def _positive_seconds(name: str, value: object) -> float:
    """`value` as a timeout: a number of seconds > 0 (0 once meant "the default" per call, and was
    taken by the constructor, where every call then failed at once) and at most a day, as the
    CLI's: gRPC's deadline in nanoseconds overflows past ~9.2e9 s (sys.maxsize, a common "no
    timeout"), failing every call DEADLINE_EXCEEDED at once, and `wait_ready(1e300)` raised
    OverflowError. Refused, not clamped: a caller's "wait for ever" is not what it gets."""
    if not _is_number(value) or not 0 < value <= DAY_SECONDS:  # type: ignore[operator]
        raise InvalidInput(f"{name} must be a number of seconds > 0 and at most {DAY_SECONDS:,} (a day), "
                           f"got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _text(name: str, value: object) -> str:
    """An argument that must be a string (a model, a salt, an id): another type failed deep inside
    protobuf or the request's encoder, or in the error message itself; bytes were taken by some
    calls (protobuf decodes them) and not by others."""
    if not isinstance(value, str):
        raise InvalidInput(f"{name} must be a string, got {type(value).__name__}")
    return value


def _flag(name: str, value: object) -> bool:
    """An argument that must be True or False ("yes" raised protobuf's bare TypeError)."""
    if not isinstance(value, bool | np.bool_):
        raise InvalidInput(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _tls_path(name: str, value: object) -> str | None:
    """A TLS file argument as a path to check and read; None for None or "" (not given)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str | Path):  # os.open(5) would read file descriptor 5
        raise InvalidInput(f"{name} must be a file name (a str or Path), got {type(value).__name__}")
    return os.fspath(value)


def _check_tls(tls_ca: object, tls_cert: object, tls_key: object) -> tuple[str | None, str | None, str | None]:
    """The TLS files as gRPC's credentials will read them, checked first (`kvstore.wire.tls_files`):
    gRPC aborted the process on a certificate that is no PEM or has no key, ignored a key without
    its certificate (the channel went out in plaintext), and failed every call after core log lines
    on a CA that is no PEM."""
    ca, cert, key = _tls_path("tls_ca", tls_ca), _tls_path("tls_cert", tls_cert), _tls_path("tls_key", tls_key)
    check_tls_ca(ca, "tls_ca")
    check_tls_client(cert, key, "tls_cert", "tls_key")
    return ca, cert, key


def _token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(tokens, list) and sys.byteorder == "little" and _U32.itemsize == 4:
        # A list (what engines hold) packed by the array module: ~4x faster than numpy's
        # conversion (0.07 against 0.29 ms for 16K ids here). What it refuses, numpy's path below
        # refuses too, with the message that says why.
        with contextlib.suppress(OverflowError, TypeError):
            return _no_bools(tokens, np.frombuffer(array.array(_U32.typecode, tokens), dtype="<u4"))
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, "token ids must be a flat list", "client")
    if arr.dtype.kind == "u" and arr.dtype.itemsize <= 4:
        return arr.astype("<u4", copy=False)  # in range by its type: no pass over the ids
    if arr.size and (not np.issubdtype(arr.dtype, np.integer) or int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT,
                                   "token ids must be integers in [0, 2**32)", "client")
    if isinstance(tokens, list | tuple):  # numpy makes [5, True] an int64 array
        _no_bools(tokens, arr)
    return arr.astype("<u4", copy=False)


def _no_bools(tokens: Sequence[Any], arr: np.ndarray) -> np.ndarray:
    """`arr`, packed from the list `tokens`, refused if the list held a bool (the array module and
    numpy take True for 1, as a numpy bool array is not). Only the items packed as 0 or 1 can be
    bools: their types are looked at, after a min() that costs ~1% of the packing (16K ids)."""
    if arr.size and arr.min() <= 1 and any(type(tokens[i]) is bool for i in np.flatnonzero(arr <= 1).tolist()):
        raise InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT,
                                   "token ids must be integers in [0, 2**32), not bools", "client")
    return arr


_U32 = array.array("I")  # C unsigned int: 4 bytes on the platforms kvstore runs on (`_token_array` checks)


def _token_u32le(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """The token ids as a contiguous little-endian uint32 array (the caller's, when it is one)."""
    return np.ascontiguousarray(_token_array(tokens), dtype="<u4")


def _load_request(model: str, tokens: Sequence[int] | np.ndarray, replay_mode: str, max_chunks: int,
                  cache_salt: str, shm_session: str = "") -> pb.LoadRequest:
    _names(model, replay_mode, cache_salt)
    max_chunks = _chunk_count("max_chunks", max_chunks, "Load")
    return pb.LoadRequest(model=model, replay_mode=replay_mode, tokens=_tokens(tokens), max_chunks=max_chunks,
                          cache_salt=cache_salt, shm_session=shm_session)


def _names(model: object, replay_mode: object, cache_salt: object) -> None:
    """The strings that name what a call is about (`_text`)."""
    _text("model", model)
    _text("replay_mode", replay_mode)
    _text("cache_salt", cache_salt)


def _register_request(model: object) -> pb.RegisterModelRequest:
    """An `EngineModel` as its request, each field checked first and named (`groups[0].num_layers`):
    protobuf's own errors named none ("Value out of range: -16"), and a dict raised AttributeError."""
    if not isinstance(model, EngineModel):
        raise InvalidInput(f"register_model takes a kvstore.layout.EngineModel, got {type(model).__name__}")
    if not isinstance(model.groups, list | tuple):
        raise InvalidInput(f"model.groups must be a tuple of EngineLayerGroup, got {type(model.groups).__name__}")
    u32 = functools.partial(_chunk_count, method="RegisterModel")
    flops = model.prefill_flops_per_token
    if isinstance(flops, bool) or not isinstance(flops, int | float | np.integer | np.floating):
        raise InvalidInput(f"model.prefill_flops_per_token must be a number, got {flops!r}")
    groups = []
    for i, g in enumerate(model.groups):
        at = f"model.groups[{i}]"
        if not isinstance(g, EngineLayerGroup):
            raise InvalidInput(f"{at} must be a kvstore.layout.EngineLayerGroup, got {type(g).__name__}")
        groups.append(pb.EngineLayerGroup(
            name=_text(f"{at}.name", g.name), num_layers=u32(f"{at}.num_layers", g.num_layers),
            kv_heads=u32(f"{at}.kv_heads", g.kv_heads), head_size=u32(f"{at}.head_size", g.head_size),
            dtype=_text(f"{at}.dtype", g.dtype), sliding_window=u32(f"{at}.sliding_window", g.sliding_window),
            latent=_flag(f"{at}.latent", g.latent)))
    return pb.RegisterModelRequest(
        model=_text("model.model", model.model), revision=_text("model.revision", model.revision),
        chunk_tokens=u32("model.chunk_tokens", model.chunk_tokens),
        vocab_size=u32("model.vocab_size", model.vocab_size), prefill_flops_per_token=float(flops), groups=groups)


def _tokens(tokens: Sequence[int] | np.ndarray) -> dict[str, bytes]:
    """The `tokens` field of a request, as the mapping its constructor fills the field from.

    Rejected: passing a built `pb.Tokens`. The constructor copies a message argument into the
    request again (serialized and parsed), which for a 32K-token prompt cost 10-100+ us per call
    against ~5 us for filling the field from a mapping."""
    return {"u32le": _token_u32le(tokens).tobytes()}


def _as_blob(payloads: Iterable[bytes | memoryview] | bytes | memoryview | np.ndarray,
             chunk_bytes: int) -> memoryview:
    """The payloads as one run of bytes: a list or tuple (or another iterable that is not a
    buffer: a generator is read once, here) holds one payload per chunk; any buffer (bytes, a
    memoryview, a numpy array) is them all, concatenated, even one whose items are not bytes, as
    long as they are plain data."""
    whole: memoryview | None = None
    if not isinstance(payloads, list | tuple):
        _not_a_tensor(payloads, "payloads")
        with contextlib.suppress(TypeError):  # not a buffer: a sequence of payloads
            whole = memoryview(payloads)  # type: ignore[arg-type]
    if whole is not None:
        if not whole.c_contiguous:
            raise InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT,
                                       "the payload buffer must be C-contiguous", "Store")
        blob = _plain(whole, "payloads").cast("B")
    else:
        if isinstance(payloads, str) or not isinstance(payloads, Iterable):
            raise InvalidInput(f"payloads must be a list of chunk payloads or one buffer of them all, "
                               f"got {type(payloads).__name__}")
        # Read once: the size check below consumed a generator, and the join then stored nothing.
        parts = payloads if isinstance(payloads, list | tuple) else list(payloads)
        views = []
        for i, p in enumerate(parts):
            view = _bytes_view(p, f"payloads[{i}]")
            if view.nbytes != chunk_bytes:
                raise InvalidArgumentError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chunk payload {i} is {view.nbytes} bytes; the layout needs {chunk_bytes}", "Store")
            views.append(view)
        blob = memoryview(b"".join(views))
    if len(blob) % chunk_bytes:
        raise InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"{len(blob)} payload bytes are not a whole number of {chunk_bytes}-byte chunks",
                                   "Store")
    return blob


# The item formats (struct's codes) of plain data: integers, floats, complex numbers, bools, bytes.
# A numpy object array ('O') or a ctypes array of pointers holds addresses: a Store sent them as KV
# bytes, and a `load_into` wrote KV bytes over them (the process crashed at the next read of an item).
_PLAIN_FORMAT = re.compile(r"[@=<>!]?[0-9]*(?:[bBhHiIlLqQnNefdg?cs]|Z[efdg])")


def _plain(view: memoryview, name: str) -> memoryview:
    """`view`, refused unless its items are plain data (`_PLAIN_FORMAT`)."""
    if not _PLAIN_FORMAT.fullmatch(view.format):
        held = "Python objects" if view.format.lstrip("@=<>!") == "O" else "items that are not plain numbers"
        raise InvalidInput(f"{name} must hold bytes or numbers; it holds {held} (format {view.format!r})")
    return view


def _not_a_tensor(value: object, name: str) -> None:
    """A torch tensor (not a buffer) is said as such: its elements, iterated, were each refused as
    "not bytes-like", and one given as a whole read as a list of payloads."""
    if type(value).__module__.split(".")[0] == "torch":
        raise InvalidInput(f"{name} is a torch tensor, not a buffer: pass tensor.cpu().numpy() (for bfloat16, "
                           "tensor.cpu().view(torch.uint8).numpy())")


def _bytes_view(value: object, name: str) -> memoryview:
    """`value` (one chunk's payload, a snapshot) as a flat byte view, or InvalidInput naming `name`."""
    _not_a_tensor(value, name)
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInput(f"{name} must be bytes-like (bytes, a memoryview, a numpy array), "
                           f"got {type(value).__name__}") from None
    if not view.c_contiguous:
        raise InvalidInput(f"{name} must be C-contiguous (np.ascontiguousarray makes a copy that is)")
    return view if view.format == "B" and view.ndim == 1 else _plain(view, name).cast("B")


def _gpu_bytes(buffer: Any) -> Any | None:
    """A torch tensor on a GPU as a 1-D uint8 tensor over its memory; None for anything else
    (torch is not imported for it)."""
    if type(buffer).__module__.split(".")[0] != "torch" or not getattr(buffer, "is_cuda", False):
        return None
    import torch  # already imported: the buffer is one of its tensors

    if not buffer.is_contiguous():
        raise InvalidInput("load_into needs a contiguous tensor")
    return buffer.reshape(-1).view(torch.uint8)


def _writable_bytes(buffer: Any) -> memoryview:
    """`buffer` as a flat writable byte view, or a clear error."""
    try:
        mv = memoryview(buffer)
    except TypeError:
        raise InvalidInput(f"load_into needs a writable buffer, not {type(buffer).__name__}") from None
    if mv.readonly:
        raise InvalidInput("load_into needs a writable buffer; this one is read-only")
    if not mv.c_contiguous:
        raise InvalidInput("load_into needs a C-contiguous buffer")
    return mv if mv.format == "B" and mv.ndim == 1 else _plain(mv, "the load_into buffer").cast("B")
