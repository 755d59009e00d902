"""Whether a gRPC target string names a kvstore service, judged before anything dials it: gRPC
dials a host without a port on 443 (TLS's, never kvstore's), fails '' and 'host:abc' at every
(re)connect (a runner or engine retried for ever), dials 127.0.0.1:99999 as port 34463 (the port
modulo 65536) without a word, and resolves http://host:port as a host named "http"."""

from __future__ import annotations

import re

# host:port or [v6]:port, alone or after a scheme's "//" (dns:///host:port).
_HOST_PORT = re.compile(r"(\[[^\]]*\]|[^:\[\]/]*):([0-9]+)")
_ADDRESS_SCHEMES = ("unix:", "unix-abstract:", "vsock:", "ipv4:", "ipv6:")
FORMS = "HOST:PORT (or unix:///PATH for the service's Unix socket)"


def target_problem(target: object) -> str | None:
    """What is wrong with `target` as the address of a service, or None: HOST:PORT ([v6]:PORT),
    alone or after `dns:`, or an address after one of gRPC's socket schemes."""
    if not isinstance(target, str):
        return f"expected {FORMS} as a string, got {target!r}"
    if not target.strip():
        return f"{target!r}: expected {FORMS}"
    if not target.isprintable():
        return f"{target!r}: must be printable characters"
    if target.startswith("xds:"):
        return None  # resolved by gRPC's xDS client from its bootstrap file
    for scheme in _ADDRESS_SCHEMES:
        if target.startswith(scheme):
            after = target.removeprefix(scheme)
            if not after.strip("/"):
                return f"{target!r}: names no address after {scheme}"
            if scheme == "unix:" and after.startswith("//") and not after.startswith("///"):
                # gRPC reads unix://run/kvstore.sock as an authority "run", not a path.
                return f"{target!r}: an absolute path takes three slashes, unix:///PATH"
            return None
    scheme, sep, after = target.partition("://")
    if sep and scheme not in ("dns", "passthrough"):
        return f"{target!r}: a gRPC target is {FORMS}, not a {scheme}:// URL"
    rest = after.rsplit("/", 1)[-1] if sep else target.removeprefix("dns:")
    m = _HOST_PORT.fullmatch(rest)
    if m is None or not m.group(1).strip("[]") or any(c.isspace() for c in m.group(1)):
        return f"{target!r}: expected {FORMS}"
    if not 1 <= int(m.group(2)) <= 65535:
        return f"{target}: the port must be in 1..65535"
    return None
