"""A service whose runners attach over its own `Runners` servicer, for the attach tests: the
service's config names the models and the reference seed, and `KvstoreServer` wires the servicer
(the weights each model's runners must declare, where each Attach is reported) and, with
`admin_port=0`, the admin server that exports what the servicer counts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.service.runners_servicer import RunnersServicer
from tests.fixtures.service import Service, make_config


@dataclass
class AttachService:
    svc: Service

    @property
    def servicer(self) -> RunnersServicer:
        return self.svc.server.runners

    @property
    def address(self) -> str:
        return self.svc.address


def start_attach_service(make_service: Callable[..., Service], models: Sequence[str], reference_seed: int = 0,
                         **kw: Any) -> AttachService:
    cfg = make_config(replay={"runner": "attached", "mode": "exact", "device": "cpu",
                              "reference_seed": reference_seed},
                      service={"models": list(models), "max_concurrent_calls": 8},
                      local_pool={"capacity_bytes": 1 << 20, "ttl": {"kind": "fixed", "ttl_seconds": 60.0}})
    return AttachService(make_service(cfg, **kw))
