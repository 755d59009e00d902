"""Whether TLS files can make gRPC credentials, judged before gRPC reads them: it takes any readable
file as a CA (then logs from its core and fails each connection, which a runner retries for ever),
aborts the process (SIGABRT) on a client certificate without its key or on one that is no PEM
certificate, and takes no passphrase. Shared by the client (named by its arguments) and the
commands (named by their flags or config keys)."""

from __future__ import annotations

import errno
import ipaddress
import re
import ssl

from kvstore.config.files import open_regular
from kvstore.errors import InvalidInput

# A CA bundle is a few hundred KiB (the system's ~200 certificates); past this a file is no TLS file,
# and OpenSSL would read it whole.
MAX_TLS_FILE_BYTES = 16 << 20
# A DNS name as certificates carry one (RFC 1123 labels; a leading "*." is a certificate's, not a name's).
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"(?=.{{1,253}}\Z){_LABEL}(\.{_LABEL})*\.?\Z")


def check_readable(path: str | None, name: str) -> None:
    """A file read later (a TLS certificate or key): here it is said as `name`'s."""
    if path is None:
        return
    try:
        with open_regular(path, MAX_TLS_FILE_BYTES):
            pass
    except OSError as e:
        # A pipe (`<(vault read ...)`) cannot serve: the file is read here, then by ssl, then by gRPC.
        why = (": it is read more than once; write it to a file (on a tmpfs, for a secret)"
               if e.errno == errno.ESPIPE else "")
        raise InvalidInput(f"{name} {path}: {e.strerror or e}{why}") from None
    except ValueError:  # a NUL in the name
        raise InvalidInput(f"{name} {path!r}: a file name cannot contain a NUL") from None


def check_tls_ca(path: str | None, name: str) -> None:
    """A CA file that holds PEM certificates."""
    if path is None:
        return
    check_readable(path, name)
    if not _pem_certificates(path):
        raise InvalidInput(f"{name} {path}: not a PEM CA certificate")


def check_tls_client(cert: str | None, key: str | None, cert_name: str, key_name: str) -> None:
    """A certificate (a client's for mTLS, or the server's) and its key: both or neither, in PEM, the
    key unencrypted and the certificate's."""
    if cert is None and key is None:
        return
    if cert is None or key is None:
        raise InvalidInput(f"{cert_name} and {key_name} go together (mTLS): give both or neither")
    check_readable(cert, cert_name)
    check_readable(key, key_name)
    if not _pem_certificates(cert):
        raise InvalidInput(f"{cert_name} {cert}: not a PEM certificate")

    def no_passphrase() -> str:
        raise ValueError("it is encrypted, and gRPC takes no passphrase")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=no_passphrase)
    except ValueError as e:
        raise InvalidInput(f"{key_name} {key}: {e}") from None
    except ssl.SSLError as e:
        why = f" ({e.reason.replace('_', ' ').lower()})" if e.reason and e.reason != "PEM_LIB" else ""
        raise InvalidInput(f"{key_name} {key}: not the PEM private key of {cert_name} {cert}{why}") from None


def check_tls_server_name(server_name: object, name: str, tls: bool) -> str | None:
    """The name the service's certificate is checked against in place of the address's host (a
    service dialled by IP address, or through a name its certificate does not carry): a DNS name or
    an IP address. Without TLS it would be ignored, and every check it was meant for skipped."""
    if server_name is None or server_name == "":
        return None
    if not isinstance(server_name, str) or not (_DNS_NAME.match(server_name) or _ip_address(server_name)):
        shown = repr(server_name)
        raise InvalidInput(f"{name} must be the host name (or IP address) the service's certificate names, "
                           f"got {shown[:80]}{'...' if len(shown) > 80 else ''}")
    if not tls:
        raise InvalidInput(f"{name} is for TLS, which is off: turn it on with a CA (or a client certificate)")
    return server_name


def _ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _pem_certificates(path: str) -> bool:
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, ValueError):
        return False
    return True
