"""Opening a file that a command or a config names, to read it, with a bound on what it costs: never
larger than its reader expects, and never waiting for ever. A regular file is size-checked before it
is read. A FIFO (`<(envsubst < tmpl)`, `cat cfg | kvstore ... /dev/stdin`) or a character device is
read where its reader can take a stream, waiting at most `PIPE_WAIT_SECONDS` (a FIFO with no writer
would block the open, or the first read, for ever) and never past the size cap (/dev/zero never
ends); where it cannot (`open_regular`), it is refused. A directory, a socket or a block device is
always refused. Each refusal is an `OSError` whose `strerror` says why, so that a caller's one-line
"cannot read ..." says it too. Shared by the config loader, the TLS file checks and the trace reader."""

from __future__ import annotations

import errno
import math
import os
import select
import stat
import time
from typing import BinaryIO

# How long a FIFO or device may take to deliver: its first byte (a stream) or all of it (a whole
# read). Seconds; read when called, so that a test may set it shorter.
PIPE_WAIT_SECONDS = 10.0

# What `fstat` says a file is, where it is not a regular one.
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _is_stream(mode: int) -> bool:
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def _open(path: str | os.PathLike[str], most_bytes: int | None, streams: bool) -> tuple[int, bool]:
    """`path`'s descriptor, opened without blocking (a FIFO's open waits for a writer), and whether
    it is a stream; an OSError where it is neither a regular file within `most_bytes` nor (with
    `streams`) a FIFO or character device. A stream is refused with ESPIPE (it cannot be read
    twice), anything else with EINVAL."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if _is_stream(st.st_mode) and streams:
            return fd, True
        if not stat.S_ISREG(st.st_mode):
            code = errno.ESPIPE if _is_stream(st.st_mode) else errno.EINVAL
            raise OSError(code, f"{_kind(st.st_mode)}, not a regular file")
        if most_bytes is not None and st.st_size > most_bytes:
            raise OSError(errno.EFBIG, f"{st.st_size:,} bytes, more than the {most_bytes:,} it may hold")
        return fd, False
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: str | os.PathLike[str], most_bytes: int | None = None) -> BinaryIO:
    """`path` opened to read in binary, if it is a regular file of at most `most_bytes` (None: any
    size); else an OSError saying what it is (ESPIPE for a FIFO or device: for a reader that reads
    the file more than once)."""
    fd, _ = _open(path, most_bytes, streams=False)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def open_stream(path: str | os.PathLike[str]) -> BinaryIO:
    """`path` opened to read in binary, once its first byte (or its end) is there: a regular file at
    once, a FIFO or device within `PIPE_WAIT_SECONDS` (after that the writer sets the pace, as any
    pipe's does). Its reader bounds what it reads (a line's length, say)."""
    fd, stream = _open(path, None, streams=True)
    try:
        if stream and not _ready(fd, time.monotonic() + PIPE_WAIT_SECONDS):
            raise OSError(errno.ETIMEDOUT, _silent(_kind(os.fstat(fd).st_mode), 0))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_capped(path: str | os.PathLike[str], most_bytes: int) -> bytes:
    """The whole of `path`, at most `most_bytes` of it: a regular file (one that grew past the cap
    while being read is refused too), or a FIFO or device that ends within `PIPE_WAIT_SECONDS`."""
    fd, stream = _open(path, most_bytes, streams=True)
    with os.fdopen(fd, "rb") as f:
        if stream:
            raw = _read_stream(fd, _kind(os.fstat(fd).st_mode), most_bytes)
        else:
            os.set_blocking(fd, True)
            raw = f.read(most_bytes + 1)
    if len(raw) > most_bytes:
        raise OSError(errno.EFBIG, f"more than the {most_bytes:,} bytes it may hold")
    return raw


def _read_stream(fd: int, kind: str, most_bytes: int) -> bytes:
    """Up to `most_bytes + 1` bytes of a non-blocking FIFO or device, to its end. Only once it has
    been ready is an empty read its end: before, on a FIFO opened without blocking, it says no
    writer has come yet. One that ends with no data is refused: a pipe is read once, and read again
    (serve's reload) it is empty, which as a config would put back every default."""
    deadline = time.monotonic() + PIPE_WAIT_SECONDS
    chunks: list[bytes] = []
    n = 0
    while n <= most_bytes:
        if not _ready(fd, deadline):
            raise OSError(errno.ETIMEDOUT, _silent(kind, n))
        try:
            while n <= most_bytes:
                chunk = os.read(fd, min(1 << 16, most_bytes + 1 - n))
                if not chunk:
                    if n == 0:
                        raise OSError(errno.ENODATA, f"{kind} that ended with no data")
                    return b"".join(chunks)
                chunks.append(chunk)
                n += len(chunk)
        except BlockingIOError:  # its writer is there but has sent nothing more yet
            pass
    return b"".join(chunks)


def _ready(fd: int, deadline: float) -> bool:
    """Whether `fd` has data, or its end, before `deadline` (poll, not select: serve's descriptors
    may number past select's 1024)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while (left := deadline - time.monotonic()) > 0:
        if poller.poll(max(1, math.ceil(left * 1000))):
            return True
    return False


def _silent(kind: str, got: int) -> str:
    if got == 0:
        return f"no data within {PIPE_WAIT_SECONDS:g} s ({kind}): nothing writes to it?"
    return f"not ended within {PIPE_WAIT_SECONDS:g} s ({kind}, {got:,} bytes came): does its writer hang?"
