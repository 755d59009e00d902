"""Live mode against the real service (in process, port 0, the reference runner on CPU), and its
agreement with the simulated mode on the same small workload.

Stated tolerance: on the same timeline the two modes must agree exactly on every request's case,
global hit and replay tokens, and on the token hit rate; the split of hits between tiers may
differ by up to 0.1 (absolute, per tier), because a Resume that replays streams the prefix while
the replay reads it in another thread, and which of the two promotes an SSD chunk first is a race
in the service (the simulated mode lets the stream read first).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.errors import Unavailable
from kvstore.service.app import build_app
from kvstore.service.server import KvstoreServer
from kvstore.workload.generator import WorkloadSpec, generate
from kvstore.workload.live import LiveOptions, run_live, service_config, timeline_config
from kvstore.workload.simulator import SimConfig, simulate

TOY = "reference-toy-8"
KiB = 1 << 10
# Returns either well inside (5 s) or well after (1000 s) the 300 s TTL; tiers small enough that
# chunks move between device, DRAM and SSD.
SPEC = WorkloadSpec(sessions=8, concurrency=4, turns=5, context_tokens=6_000, system_tokens=512, output_tokens=64,
                    tenants=2, think_time="0.5*fixed(5)+0.5*fixed(1000)")


def test_live_and_simulated_agree_on_the_same_workload(tmp_path: Path) -> None:
    w = generate(SPEC)
    opts = LiveOptions(model=TOY, sim=SimConfig(), device_capacity_bytes=512 * KiB, dram_capacity_bytes=1024 * KiB,
                       data_dir=str(tmp_path))
    live = run_live(w, opts)
    sim = simulate(w, timeline_config(opts, service_config(opts)))
    for name in ("case", "hit", "usable", "replay", "local_reason", "written_chunks", "snapshot_written"):
        assert getattr(live.log, name).tolist() == getattr(sim.log, name).tolist(), name
    ls, ss = live.summary(), sim.summary()
    assert {c: ls["cases"][c]["count"] for c in ls["cases"]} == {c: ss["cases"][c]["count"] for c in ss["cases"]}
    assert all(ls["cases"][c]["count"] > 0 for c in ("cold", "warm", "expired"))
    assert ls["hit_rate_by_tier"]["miss"] == pytest.approx(ss["hit_rate_by_tier"]["miss"], abs=1e-12)
    for tier in ("device", "dram", "lmdb"):
        assert ls["hit_rate_by_tier"][tier] == pytest.approx(ss["hit_rate_by_tier"][tier], abs=0.1), tier
    assert ls["persistent_bytes_ratio_vs_baseline"] == pytest.approx(ss["persistent_bytes_ratio_vs_baseline"],
                                                                     rel=1e-9)
    assert live.counters["live"]["replay_status"] == {"replayed": ls["cases"]["expired"]["count"]}
    assert ls["mode"] == "live" and ss["mode"] == "simulated"
    # One clock for every case (the cost model's, on the live service's answers), the simulated
    # mode's: with the same decisions, the same times. With this machine's CPU replay added to a
    # modelled GPU prefill, live expired read 10-500x the simulated one.
    for c in ("cold", "warm", "expired"):
        assert ls["cases"][c]["ttft_p50_ms"] == pytest.approx(ss["cases"][c]["ttft_p50_ms"], rel=0.25), c
    assert "modelled for every case" in live.settings["live"]["ttft"]


def test_live_refuses_to_run_without_a_replayer(tmp_path: Path) -> None:
    # The in-process reference runner cannot replay DeepSeek-V4.1-Flash: no fake numbers.
    opts = LiveOptions(model="deepseek-v4.1-flash", sim=SimConfig(), data_dir=str(tmp_path))
    w = generate(WorkloadSpec(sessions=1, turns=2, context_tokens=2_048, system_tokens=256, output_tokens=64,
                              tenants=1))
    with pytest.raises(Unavailable, match="reference runner"):
        run_live(w, opts)


def test_live_against_a_running_service(tmp_path: Path) -> None:
    # `--target`: the service keeps its own (wall) clock; at time scale 1e-4 the 5 s think times
    # are 0.5 ms of wall time, far inside its 300 s TTL, as they are in simulated time.
    spec = WorkloadSpec(sessions=3, concurrency=3, turns=3, context_tokens=3_000, system_tokens=256,
                        output_tokens=32, tenants=1, think_time="fixed(5)")
    opts = LiveOptions(model=TOY, sim=SimConfig(), time_scale=1e-4)
    app = build_app(service_config(opts), tmp_path / "data")
    server = KvstoreServer(app, port=0, admin_port=-1).start()
    w = generate(spec)
    target = LiveOptions(model=TOY, sim=SimConfig(), target=server.address, time_scale=1e-4)
    try:
        live = run_live(w, target)
    finally:
        server.stop(1.0)
        app.close()
    sim = simulate(w, timeline_config(target, None))
    assert live.log.case.tolist() == sim.log.case.tolist()
    assert live.log.hit.tolist() == sim.log.hit.tolist()
    assert live.summary()["cases"]["warm"]["count"] >= 6  # every return within the TTL is warm
    assert live.settings["live"]["clock"] == "wall"


def test_live_with_a_model_that_keeps_no_local_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # dense-gqa-32l keeps no local state: the driver sent StoreLocal anyway, the service refused it
    # (INVALID_ARGUMENT "keeps no local state") and the run exited 2; with replay on it was also refused
    # for want of a replayer, though there is nothing to replay. Every global hit is warm.
    spec = WorkloadSpec(sessions=2, concurrency=2, turns=3, context_tokens=2_048, system_tokens=256,
                        output_tokens=32, tenants=1, think_time="fixed(1000)")
    opts = LiveOptions(model="dense-gqa-32l", sim=SimConfig(replay_mode="off"), data_dir=str(tmp_path))
    w = generate(spec)
    live = run_live(w, opts)
    sim = simulate(w, timeline_config(opts, service_config(opts)))
    assert live.log.case.tolist() == sim.log.case.tolist()
    # One cold request; the other session's first turn hits the tenant's shared system prompt.
    assert sorted(live.log.case.tolist()) == [0, 1, 1, 1, 1, 1]  # none expired, all returned after the TTL
    assert live.log.snapshot_written.tolist() == [0] * 6 and live.pool_byte_seconds == 0.0
    assert sim.counters["pool"]["writes"] == 0
    # And from the command line, with replay on (the default): no replayer is asked for.
    argv = ["bench", "workload", "--mode", "live", "--model", "dense-gqa-32l", "--sessions", "2", "--turns", "2",
            "--context-tokens", "2048", "--system-tokens", "256", "--output-tokens", "32", "--tenants", "1", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
