"""Why TLS with a service cannot work, told by a handshake of the caller's own.

gRPC reports a service that drops a connection whose client certificate it does not take, and a
TLS port dialled in plaintext, as "Socket closed", as it does a service going away: a caller that
reconnects on such an error (`kvstore runner`) would reconnect for ever. `tls_refusal` dials the
same address with Python's `ssl` and the same files, and says which it is, or "" where it cannot
tell (no answer, a handshake cut short, a target that is no host:port)."""

from __future__ import annotations

import socket
import ssl

TLS_PROBE_SECONDS = 3.0
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH
_NAME_MISMATCH = (62, 64)


def tls_refusal(target: str, tls_ca: str | None, tls_cert: str | None, tls_key: str | None,
                server_name: str | None = None) -> str:
    """Why TLS between a client with these files (none: plaintext) and `target` fails in a way no
    reconnect mends; "" when it does not, or cannot be told. `server_name`: the name the service's
    certificate is checked against instead of the target's host, as the client's channel does."""
    where = _host_port(target)
    if where is None:
        return ""
    host, port = where
    tls = bool(tls_ca or tls_cert)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.set_alpn_protocols(["h2"])
    try:
        if not tls:  # asked only whether the port speaks TLS
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        elif tls_ca:
            ctx.load_verify_locations(tls_ca)
        else:
            ctx.load_default_certs()
        if tls_cert:
            ctx.load_cert_chain(tls_cert, tls_key)
        raw = socket.create_connection((host, port), timeout=TLS_PROBE_SECONDS)
    except OSError:  # ssl.SSLError included: the files changed since they were checked
        return ""
    with raw:
        try:
            conn = ctx.wrap_socket(raw, server_hostname=server_name or host)
        except ssl.SSLCertVerificationError as e:
            if e.verify_code in _NAME_MISMATCH:
                return (f"the service's certificate does not name {server_name or host} ({e.verify_message}); "
                        "give the name it carries (--tls-server-name)")
            return f"the service's certificate is not trusted ({e.verify_message}); check --tls-ca"
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError, TimeoutError, ConnectionError):
            return ""  # cut off mid-handshake: a service going away does that too
        except ssl.SSLError as e:
            return "" if not tls else f"the handshake failed ({e.reason or e}): does the service use TLS?"
        with conn:
            if not tls:
                return "the service speaks TLS: connect with TLS (kvstore runner --tls-ca FILE)"
            try:
                conn.sendall(_H2_PREFACE)
                if conn.recv(1):
                    return ""  # it speaks HTTP/2 over this TLS: the stream ended for another reason
            except TimeoutError:
                return ""
            except ssl.SSLError as e:
                if e.reason and not isinstance(e, ssl.SSLEOFError | ssl.SSLZeroReturnError):
                    return f"the service refused the TLS connection ({e.reason})"
            except ConnectionError:
                pass
    given = "none was given (--tls-cert, --tls-key)" if not tls_cert else f"it refuses {tls_cert}"
    return ("the service closed the connection as soon as the TLS handshake ended: it requires a client "
            f"certificate (signed by its service.tls_client_ca_file), and {given}")


def _host_port(target: str) -> tuple[str, int] | None:
    """The host and port of a HOST:PORT or dns: target (None for a socket scheme's, or xDS's)."""
    scheme, sep, rest = target.partition("://")
    if sep:
        if scheme not in ("dns", "passthrough"):
            return None
        rest = rest.rsplit("/", 1)[-1]
    elif target.startswith(("unix:", "unix-abstract:", "vsock:", "ipv4:", "ipv6:", "xds:")):
        return None
    else:
        rest = target.removeprefix("dns:")
    host, _, port = rest.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return (host, int(port)) if host and port.isdigit() else None
