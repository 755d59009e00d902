"""Checks of flags that several commands share, made before anything is dialled or read: a bad value
is one line naming the flag (exit 2), not a traceback from deep inside, a gRPC core log line, or a
runner that reconnects for ever."""

from __future__ import annotations

import urllib.parse

from kvstore.config.fields import DAY_SECONDS
from kvstore.config.service import token_problem
from kvstore.errors import InvalidInput
from kvstore.wire.targets import target_problem
from kvstore.wire.tls_files import check_tls_ca, check_tls_client


def check_token(token: str | None, flag: str) -> None:
    """A bearer token that could be sent (gRPC refuses header values it cannot carry, after a log
    line of its own, with INTERNAL) and matched (the service strips the presented token)."""
    problem = token_problem(token) if token is not None else None
    if problem is not None:
        raise InvalidInput(f"{flag}: the token {problem}")


def check_not_empty(path: str | None, flag: str, what: str) -> None:
    """A path flag given as '': Path('') is '.', so it was read as the current directory ("cannot read
    config file .: Is a directory"), LMDB went into it, or it was taken for the flag left out."""
    if path == "":
        raise InvalidInput(f"{flag} must not be empty (it names a {what})")


def check_server_tls(cert: str, key: str, client_ca: str) -> None:
    """The config's TLS files ("" where unset), checked as the flags are, named by their keys:
    gRPC takes any readable file, logs from its core, and the bind fails blaming the port."""
    if cert or key:
        check_tls_client(cert or None, key or None, "service.tls_cert_file", "service.tls_key_file")
    check_tls_ca(client_ca or None, "service.tls_client_ca_file")


def check_target(target: str, flag: str) -> None:
    """A gRPC target that names a service (`kvstore.wire.targets`), or one line naming `flag`."""
    if (problem := target_problem(target)) is not None:
        raise InvalidInput(f"{flag} {problem}")


def check_timeout(seconds: float, flag: str) -> None:
    """A finite timeout of at most a day: gRPC takes a past (or overflowed, 1e300) deadline and fails
    the call blaming the service; urllib takes 0 as non-blocking and 1e300 with an OverflowError."""
    if not 0 < seconds <= DAY_SECONDS:
        raise InvalidInput(f"{flag} must be a positive number of seconds, at most {DAY_SECONDS:,} (a day), "
                           f"got {seconds:g}")


def check_admin_url(url: str, flag: str) -> str:
    """An admin port's address (a URL, or HOST:PORT for http://) as the base URL to ask. urllib
    dials port 99999 as 34463, tries FTP for ftp://, and takes a port that is no number or a space
    in the URL for an answer that is not HTTP ("is this the gRPC port?")."""
    base = url if "://" in url else f"http://{url}"
    if any(c <= " " or c == "\x7f" for c in base):
        raise InvalidInput(f"{flag} {url!r} is not a URL: it holds a space or a control character")
    try:
        parts = urllib.parse.urlsplit(base)
    except ValueError as e:  # 'http://[::1'
        raise InvalidInput(f"{flag} {url!r} is not a URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidInput(f"{flag} {url}: the admin port speaks http:// or https://, not {parts.scheme}://")
    if not parts.hostname:
        raise InvalidInput(f"{flag} {url!r} names no host")
    try:
        port = parts.port
    except ValueError:  # not a number, or past 65535
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise InvalidInput(f"{flag} {url}: the port must be a number in 1..65535")
    return base
