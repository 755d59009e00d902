"""What the admin port's 401 and `kvstore explain --help` say a caller needs is what the port takes:
/api/* takes the admin token or a tenant's (which sees only its own tenant's data), /metrics behind
`metrics_require_token` the admin token only. Both used to say "the admin token" everywhere."""

from __future__ import annotations

import json
from pathlib import Path

from kvstore.cli import build_parser
from kvstore.service.admin_server import _tenant_of_token
from tests.test_admin_http import ADMIN, get
from tests.test_admin_workload import Rig, small_config, workload


def test_the_401_says_which_tokens_pass_where(tmp_path: Path) -> None:
    cfg = small_config(admin_token=ADMIN, metrics_require_token=True)
    rig = Rig(tmp_path, cfg=cfg)
    try:
        workload(rig, minutes=2, sessions=3)
        srv = rig.serve(tenant_of_token=_tenant_of_token(cfg))
        for path in ("/api/stats", "/api/timeseries", "/api/explain/req-0001"):
            status, _, body = get(srv, path)
            message = json.loads(body)["error"]["message"]
            assert status == 401 and "the admin token, or a tenant's" in message, message
            assert get(srv, path, "acme-token-1234")[0] != 401  # ... as it says
        status, _, body = get(srv, "/metrics")
        message = json.loads(body)["error"]["message"]
        assert status == 401 and "<admin token>" in message and "tenant" not in message, message
    finally:
        rig.close()


def test_explain_says_a_tenants_token_explains_that_tenants_requests() -> None:
    explain = build_parser()._subparsers._group_actions[0].choices["explain"]
    token = next(a for a in explain._actions if "--token" in a.option_strings)
    assert token.help is not None and "or a tenant's token" in token.help, token.help
