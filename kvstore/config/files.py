"""Opening a file that a command or a config names, to read it: only a regular file, and never one
larger than its reader expects. A FIFO with no writer would block the open (and the command) for
ever, and /dev/zero or a huge file would be read until memory runs out; both are refused with an
`OSError` whose `strerror` says why, so that a caller's one-line "cannot read ..." says it too.
Shared by the config loader, the TLS file checks and the trace reader."""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

# What `fstat` says a file is, where it is not a regular one.
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path: str | os.PathLike[str], most_bytes: int | None = None) -> BinaryIO:
    """`path` opened to read in binary, if it is a regular file of at most `most_bytes` (None: any
    size); else an OSError saying what it is. Opened without blocking (a FIFO's open waits for a
    writer), then made blocking again to be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
            raise OSError(errno.EINVAL, f"{kind}, not a regular file")
        if most_bytes is not None and st.st_size > most_bytes:
            raise OSError(errno.EFBIG, f"{st.st_size:,} bytes, more than the {most_bytes:,} it may hold")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], most_bytes: int) -> bytes:
    """The whole of a regular file of at most `most_bytes` (`open_regular`); one that grew past it
    while being read is refused too."""
    with open_regular(path, most_bytes) as f:
        raw = f.read(most_bytes + 1)
    if len(raw) > most_bytes:
        raise OSError(errno.EFBIG, f"more than the {most_bytes:,} bytes it may hold")
    return raw
