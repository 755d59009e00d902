"""`kvstore tune ttl --config` against a real service whose embedded pool is too small for its
interleaved sessions: the TTL it recommends must be one the pool holds without evicting (applied,
the service gets the hits predicted), and the TTLs it does not hold are marked with their peak.
Before: tune priced an unbounded pool (room for 3 snapshots, 6 interleaved sessions: every return
replayed, while tune predicted every one would hit), and `--pool-capacity-bytes` did not exist."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.config import load_config
from kvstore.local_pool.embedded import ENTRY_OVERHEAD_BYTES
from kvstore.observe.trace_recorder import TraceRecorder
from tests.test_metrics_service import CHUNK, MODEL, Running, prompt, start, store

SESSIONS = 6
DECODE = 2.0  # seconds from a request to its StoreLocal
QUICK = 5.0  # from a turn's StoreLocal to the same session's next turn (a quick follow-up)
GAP = 20.0  # from a session's second StoreLocal to the next session's first request
ROUNDS = 2  # the second comes back after every other session's turns: ~165 s after its last write
SNAPSHOTS_ROOM = 3


def write_config(tmp: Path, kind: str, ttl: float, snapshot: int) -> Path:
    """A config file for both `serve` and `tune --config`: an embedded pool with room for 3 snapshots."""
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "kvstore.toml"
    path.write_text(f"""
[store]
device = "cpu"
chunk_tokens = {CHUNK}
device_capacity_bytes = 1048576
dram_capacity_bytes = 2097152
lmdb_capacity_bytes = 16777216
page_bytes = 4096
compression = "none"
lmdb_durability = "async"
[local_pool]
capacity_bytes = {SNAPSHOTS_ROOM * (snapshot + ENTRY_OVERHEAD_BYTES)}
[local_pool.ttl]
kind = "{kind}"
ttl_seconds = {ttl}
replay_cost_per_token = 1.0
hold_cost_per_byte_second = 1e-7
min_ttl_seconds = 1.0
[trace]
enabled = true
path = "{tmp / 'trace.jsonl'}"
""")
    return path


def serve(tmp: Path, kind: str, ttl: float) -> tuple[Running, Path]:
    snapshot = snapshot_bytes()
    cfg_path = write_config(tmp, kind, ttl, snapshot)
    r = start(tmp / "data", load_config(str(cfg_path)))
    assert r.app.layouts()[MODEL].local_snapshot_bytes == snapshot
    tracer = next(o for o in r.app.observers if isinstance(o, TraceRecorder))
    tracer._wall = r.clock.wall  # the trace's clock is the pool's
    return r, cfg_path


def snapshot_bytes() -> int:
    from kvstore.layout import get_model

    return get_model(MODEL).layout.local_snapshot_bytes


def engine(r: Running) -> tuple[list[str], int]:
    """Six sessions, each turn in turn: a request, its StoreLocal, a quick follow-up and its StoreLocal,
    then the next session; twice round. The local state each request found (the first round's first
    turns are cold), and the pool's evictions."""
    ctx = {s: prompt(100 + s, 3) for s in range(SESSIONS)}
    found = []
    for rnd in range(ROUNDS):
        for s in range(SESSIONS):
            for turn in range(2):
                found.append(r.client.resume(MODEL, ctx[s], session=f"chat-{s}").local_state)
                r.clock.advance(DECODE)
                after = np.concatenate([ctx[s], prompt(1000 + 100 * rnd + 10 * s + turn, 1, 5)])
                store(r, after, session=f"chat-{s}")
                r.clock.advance(QUICK if turn == 0 else GAP)
                ctx[s] = np.concatenate([after[: len(after) // CHUNK * CHUNK], prompt(2000 + s, 0, 7)])
    assert r.app.local_pool is not None
    evictions = r.app.local_pool.stats().evictions
    r.stop()
    return found, evictions


def tune(trace: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:  # type: ignore[type-arg]
    capsys.readouterr()
    assert main(["tune", "ttl", "--trace", str(trace), "--model", MODEL, "--chunk-tokens", str(CHUNK), "--json",
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_a_pool_too_small_for_the_interleaved_sessions_is_priced_and_its_ttl_not_recommended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r, cfg = serve(tmp_path / "a", "fixed", 300.0)
    found, evictions = engine(r)
    returns = [x for i, x in enumerate(found) if not (i < 2 * SESSIONS and i % 2 == 0)]  # all but the cold ones
    assert len(returns) == 3 * SESSIONS and evictions > 0
    assert returns.count("hit") < len(returns)  # the pool evicted what 300 s would have kept
    trace = tmp_path / "a" / "trace.jsonl"
    snap = snapshot_bytes() + ENTRY_OVERHEAD_BYTES
    capacity = SNAPSHOTS_ROOM * snap

    # Tuned with the service's own config, and applied: the pool holds the recommendation without
    # evicting, and the hits are the ones predicted. (Before: it recommended a TTL predicted to keep
    # every return; applied, the pool evicted 21 snapshots.)
    rep = tune(trace, capsys, "--ttl", "300", "--config", str(cfg))
    rec = rep["recommended"]
    r2, _ = serve(tmp_path / "b", rec["kind"], rec["ttl_seconds"])
    found2, evictions2 = engine(r2)
    assert evictions2 == 0
    assert [x for i, x in enumerate(found2) if not (i < 2 * SESSIONS and i % 2 == 0)].count("hit") == rec["local_hits"]
    # The quick follow-ups hit within the room; the returns after a round do not.
    assert QUICK < rec["ttl_seconds"] < GAP and rec["local_hits"] == ROUNDS * SESSIONS

    # 300 s holds every snapshot at once, over the room for 3: marked, with its peak.
    assert rep["pool"]["capacity_bytes"] == capacity and rep["pool"]["entry_overhead_bytes"] == ENTRY_OVERHEAD_BYTES
    assert "local_pool.capacity_bytes" in rep["pool"]["from"] and rep["pool"]["warning"] is None
    row = next(x for x in rep["rows"] if x["semantics"] == "fixed")
    assert row["local_hits"] == len(returns)  # an upper bound: the pool evicts
    assert row["peak_bytes"] > capacity and row["fits_pool"] is False
    assert row["peak_bytes"] % snap == 0 and 0 < row["mean_bytes"] <= row["peak_bytes"]
    assert rec["fits_pool"] is True and rec["peak_bytes"] <= capacity and rec["search"] == "capacity"
    # The search's least-cost TTL kept the long returns too, and did not fit: it is named, not set.
    excluded = rep["best_fixed"]["excluded"]
    assert excluded["peak_bytes"] > capacity and excluded["ttl_seconds"] > rec["ttl_seconds"]

    # Without a capacity, as before: every return predicted to hit at 300 s, and nothing checked.
    plain = tune(trace, capsys, "--ttl", "300", "--replay-cost-per-token", "1", "--hold-cost-per-byte-second", "1e-7")
    row = next(x for x in plain["rows"] if x["semantics"] == "fixed")
    assert row["local_hits"] == len(returns) and row["fits_pool"] is None
    assert plain["pool"]["capacity_bytes"] is None and plain["pool"]["from"].startswith("not checked")
    assert plain["recommended"]["local_hits"] == len(returns) and plain["recommended"]["fits_pool"] is None

    # The text marks the row and says where the capacity came from.
    capsys.readouterr()
    assert main(["tune", "ttl", "--trace", str(trace), "--model", MODEL, "--chunk-tokens", str(CHUNK), "--ttl", "300",
                 "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert f"({capacity:,} B, from {cfg}'s local_pool.capacity_bytes)" in out
    assert "OVER" in next(x for x in out.splitlines() if x.split()[:2] == ["300", "fixed"]).split()
    assert "fixed at the least-cost TTL found that fits the pool" in out


def test_where_no_ttl_fits_a_warning_names_the_peak_needed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r, cfg = serve(tmp_path, "fixed", 300.0)
    engine(r)
    snap = snapshot_bytes() + ENTRY_OVERHEAD_BYTES
    rep = tune(tmp_path / "trace.jsonl", capsys, "--ttl", "300", "--config", str(cfg),
               "--pool-capacity-bytes", str(snap - 1))  # the flag wins over the config
    assert rep["pool"]["capacity_bytes"] == snap - 1 and rep["pool"]["from"] == "--pool-capacity-bytes"
    rec = rep["recommended"]
    assert rec["fits_pool"] is False and rec["search"] == "none_fits"
    assert f"needs room for a peak of {rec['peak_bytes']:,} B" in rep["pool"]["warning"]
    assert all(x["fits_pool"] is False for x in rep["rows"])
    assert main(["tune", "ttl", "--trace", str(tmp_path / "trace.jsonl"), "--model", MODEL, "--chunk-tokens",
                 str(CHUNK), "--pool-capacity-bytes", str(snap - 1)]) == 0
    out, err = capsys.readouterr()
    assert "kvstore tune: warning: the pool's capacity" in err and "\nwarning: the pool's capacity" in out
    assert "though the pool is too small for it" in out


@pytest.mark.parametrize("value,says", [
    ("0", "--pool-capacity-bytes must be 1 to "), ("-5", "--pool-capacity-bytes must be 1 to "),
    (str(2**70), "--pool-capacity-bytes must be 1 to "), ("1e9", "argument --pool-capacity-bytes: invalid int value"),
])
def test_the_pool_capacity_flag_is_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, says: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    capsys.readouterr()
    try:
        code = main(["tune", "ttl", "--trace", str(trace), "--pool-capacity-bytes", value])
    except SystemExit as e:  # argparse's own
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and says in err, err
    assert "holds no requests" not in err  # refused before the trace is read
