"""Checks of flags that several commands share, made before anything is dialled or read: a bad value
is one line naming the flag (exit 2), not a traceback from deep inside, a gRPC core log line, or a
runner that reconnects for ever."""

from __future__ import annotations

import re

from kvstore.config.service import token_problem
from kvstore.errors import InvalidInput

# host:port or [v6]:port, alone or after a scheme's "//" (dns:///host:port).
_HOST_PORT = re.compile(r"(\[[^\]]*\]|[^:\[\]/]*):([0-9]+)")


def check_token(token: str | None, flag: str) -> None:
    """A bearer token that could be sent (gRPC refuses header values it cannot carry, after a log
    line of its own, with INTERNAL) and matched (the service strips the presented token)."""
    problem = token_problem(token) if token is not None else None
    if problem is not None:
        raise InvalidInput(f"{flag}: the token {problem}")


def check_readable(path: str | None, flag: str) -> None:
    """A file the command reads later (a TLS certificate or key): here it is said as the flag's."""
    if path is None:
        return
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise InvalidInput(f"{flag} {path}: {e.strerror or e}") from None
    except ValueError:  # a NUL in the name
        raise InvalidInput(f"{flag} {path!r}: a file name cannot contain a NUL") from None


def check_target(target: str, flag: str) -> None:
    """A gRPC target's port, where it has one: gRPC dials 127.0.0.1:99999 as port 34463 (the port
    modulo 65536) without a word."""
    if target.startswith(("unix:", "unix-abstract:", "vsock:")):
        return
    m = _HOST_PORT.fullmatch(target.rsplit("/", 1)[-1] if "//" in target else target)
    if m is not None and not 1 <= int(m.group(2)) <= 65535:
        raise InvalidInput(f"{flag} {target}: the port must be in 1..65535")
