"""`kvstore explain REQUEST_ID [--target ADMIN_URL] [--token TOKEN] [--json]`: why a recent request
missed, asked of a running service's admin port (`/api/explain/<id>`).

It prints the request's case and bills, each run of missed chunks with its reason (never stored,
evicted by which policy and when, corrupt, over quota, ...), why the local state was not held and
why a replay happened. Exit 0 when found, 1 when the service does not know the request (unknown,
or aged out of its journal), 2 when the service cannot be asked.

What it does not know: the service's internals; it speaks HTTP to the admin port only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvstore.commands.admin_client import NotAnAdminPort, admin_get, has_fields, kvstore_error
from kvstore.commands.checks import check_admin_url, check_timeout, check_token
from kvstore.errors import InvalidInput, Unavailable
from kvstore.wire.request_ids import REQUEST_ID_RE

DEFAULT_TARGET = "http://127.0.0.1:9400"  # the admin port's default bind (config: [admin])
TOKEN_ENV = "KVSTORE_ADMIN_TOKEN"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("request_id", metavar="REQUEST_ID", help="the request id (x-request-id) to explain")
    p.add_argument("--target", default=DEFAULT_TARGET, metavar="ADMIN_URL",
                   help=f"the service's admin HTTP address (default: {DEFAULT_TARGET})")
    p.add_argument("--token", default=None,
                   help=f"the admin token, or a tenant's token, which explains only that tenant's requests "
                        f"(default: ${TOKEN_ENV}, if set)")
    p.add_argument("--json", action="store_true", help="print the explanation as JSON")
    p.add_argument("--timeout-seconds", type=float, default=5.0, help="HTTP timeout (default 5)")


# What `render_text` reads, by type: an answer without it is no explanation.
_EXPLANATION = {"request_id": str, "method": str, "model": str, "tenant": str, "summary": str, "bills": dict,
                "chunk_tokens": int, "chunks": list, "remainder_tokens": int, "local": dict, "replay": str}
_BILLS = {"prefill_tokens_avoided": int, "prefill_flops_avoided": (int, float), "prefill_tokens": int,
          "replay_tokens": int}
_RUN = {"first_chunk": int, "last_chunk": int, "reason": str, "detail": str}
_LOCAL = {"outcome": str, "reason": str, "detail": str}


def _is_explanation(doc: Any) -> bool:
    return (has_fields(doc, _EXPLANATION) and has_fields(doc["bills"], _BILLS) and has_fields(doc["local"], _LOCAL)
            and all(has_fields(c, _RUN) for c in doc["chunks"]))


def fetch(target: str, request_id: str, token: str | None, timeout_seconds: float) -> dict[str, Any] | None:
    """The explanation document, or None when the service does not know the request."""
    if not REQUEST_ID_RE.match(request_id):
        raise InvalidInput("a request id is 1-64 characters of letters, digits and . _ : -")
    base = check_admin_url(target, "--target")
    url = base.rstrip("/") + "/api/explain/" + urllib.parse.quote(request_id, safe="")
    try:  # parsing the URL: 'http://[::1' is no URL at all, said as the flag's
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    except ValueError as e:
        raise InvalidInput(f"--target {target!r} is not a URL: {e}") from None
    try:
        status, doc = admin_get(req, timeout_seconds)
    except NotAnAdminPort as e:
        raise Unavailable(f"{base}: not a kvstore admin port: {e}") from None
    except http.client.HTTPException:  # something answered, not in HTTP/1 (a gRPC port answers HTTP/2)
        raise Unavailable(f"{base}: not an HTTP admin port (is this the gRPC port?)") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise Unavailable(f"cannot reach the admin port at {base}: {reason}") from None
    message = kvstore_error(doc)
    if status == 200:
        if not _is_explanation(doc):
            raise Unavailable(f"{base}: not a kvstore admin port: its answer is no explanation of a request")
        return dict(doc)
    if message is None:  # any web server says 404; kvstore's admin port says it in its JSON error body
        raise Unavailable(f"{base}: not a kvstore admin port: it answered {status} without kvstore's error body")
    if status == 404 and message.startswith("no recent request"):
        return None
    raise Unavailable(f"{url} answered {status}: {message}")


def run(args: argparse.Namespace) -> int:
    # Else urllib takes 0 as non-blocking and refuses a negative one (both said as "cannot reach"),
    # and fails 1e300 with an OverflowError.
    check_timeout(args.timeout_seconds, "--timeout-seconds")
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    check_token(token, "--token" if args.token is not None else TOKEN_ENV)
    doc = fetch(args.target, args.request_id, token, args.timeout_seconds)
    if doc is None:
        print(f"kvstore explain: no recent request '{args.request_id}' at {args.target} "
              "(unknown, or aged out of the journal)", file=sys.stderr)
        return 1
    # Here, not at the top: the explainer imports the store (torch), which `kvstore --help` need not load.
    from kvstore.observe.explainer import render_text

    print(json.dumps(doc, indent=2) if args.json else render_text(doc))
    return 0
