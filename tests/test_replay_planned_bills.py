"""A Resume's planned bill counts the replay that will run: for a hit shorter than the replay's
reach (exact mode rebuilds from L(W-1)+1 tokens back), the replay starts at token 0 and runs the
hit, as the coordinator's plan and the final bill say, not the full reach."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvstore.layout import register_model
from kvstore.workload.demo import Engine, OffsetClock
from tests.fixtures.service import make_config, start_service
from tests.test_replay_coordinator import MODEL, NAME, SPEC, W, tokens

register_model(SPEC)


def test_the_planned_replay_of_a_hit_shorter_than_the_replay_is_the_hit(tmp_path: Path) -> None:
    cfg = make_config(replay={"runner": "reference", "mode": "exact", "device": "cpu"},
                      service={"models": [NAME]},
                      local_pool={"capacity_bytes": 1 << 20, "ttl": {"kind": "fixed", "ttl_seconds": 60.0}})
    clock = OffsetClock()
    svc = start_service(cfg, tmp_path / "data", clock=clock)
    try:
        eng = Engine(MODEL, svc.client(timeout_seconds=60.0), NAME, "exact")
        first = tokens(3, 20)  # one 16-token chunk and its snapshot at the boundary
        eng.store(first, eng.request(first))
        clock.advance(61.0)  # the snapshot expires: the next request replays
        r = eng.request(np.concatenate([first, tokens(4, 10)])).resume
        assert (r.case, r.hit_tokens, r.local_state) == ("expired", 16, "replayed")
        assert 4 * (W - 1) + 1 > 16  # exact mode's full reach is longer than this hit
        assert r.replay_tokens == r.bills.replay_tokens == 16
        assert r.planned_bills.replay_tokens == 16
    finally:
        svc.stop(0.5)
