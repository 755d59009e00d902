"""The cliff sweep and `kvstore bench workload`: sensible shape, the output contract, the plot, the trace."""

from __future__ import annotations

import argparse
import builtins
import json
from pathlib import Path
from typing import Any

import pytest

from kvstore.bench.workload import add_workload_arguments, run_workload_bench
from kvstore.errors import InvalidInput
from kvstore.observe.trace_file import read_trace
from kvstore.workload.generator import WorkloadSpec
from kvstore.workload.simulator import SimConfig
from kvstore.workload.sweep import (
    Capacity,
    SweepPoint,
    find_cliff,
    parse_capacities,
    parse_concurrencies,
    parse_size,
    run_sweep,
)

MiB = 1 << 20
# Sessions that reuse a lot of context per turn, quick returns (all inside the TTL): a miss costs a
# whole context, so throughput falls once the working set outgrows the tiers.
SPEC = WorkloadSpec(sessions=2, turns=12, context_tokens=16_384, system_tokens=2_048, output_tokens=32,
                    tenants=2, think_time="exp(2)", ramp_seconds=5)
CAPS = [Capacity(64 * MiB, 256 * MiB, 0), Capacity(128 * MiB, 1024 * MiB, 0)]


def test_cliff_moves_out_with_capacity() -> None:
    sweep = run_sweep(SPEC, SimConfig(), CAPS, [4, 8, 16, 32, 64, 128, 256])
    cliffs = [c.cliff_concurrency for c in sweep.cliffs]
    assert all(c is not None for c in cliffs), cliffs  # each capacity falls off within the sweep
    assert cliffs == sorted(cliffs)  # type: ignore[type-var]
    peaks = [c.peak_requests_per_second for c in sweep.cliffs]
    assert peaks[0] < peaks[1]  # more capacity, a higher peak...
    assert sweep.cliffs[0].peak_concurrency <= sweep.cliffs[1].peak_concurrency  # ...reached later
    for cliff in sweep.cliffs:
        row = sorted((p for p in sweep.points if p.capacity == cliff.capacity), key=lambda p: p.concurrency)
        before = [p.requests_per_second for p in row if p.concurrency <= cliff.peak_concurrency]
        assert before == sorted(before)  # throughput rises up to the peak
        at = next(p for p in row if p.concurrency == cliff.cliff_concurrency)
        assert at.requests_per_second < 0.7 * cliff.peak_requests_per_second
        peak = next(p for p in row if p.concurrency == cliff.peak_concurrency)
        assert at.global_hit_rate < peak.global_hit_rate  # the cliff is the cache falling over
        assert row[-1].concurrency == cliff.cliff_concurrency  # the sweep stops past the cliff


def _point(c: int, rps: float) -> SweepPoint:
    return SweepPoint(CAPS[0], c, 1, rps, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, None, None)


def test_find_cliff_is_the_first_drop_below_70_percent_after_the_peak() -> None:
    row = [_point(1, 1.0), _point(2, 0.5), _point(4, 2.0), _point(8, 1.5), _point(16, 1.3), _point(32, 0.2)]
    c = find_cliff(CAPS[0], row)
    assert (c.peak_concurrency, c.cliff_concurrency) == (4, 16)  # 1.3 < 0.7 x 2.0; the dip at 2 is before the peak
    assert find_cliff(CAPS[0], row[:4]).cliff_concurrency is None


def test_sizes_and_capacities_parse() -> None:
    assert parse_size("32GiB") == 32 << 30 and parse_size("1.5GB") == 1_500_000_000 and parse_size("0") == 0
    assert parse_capacities("4GiB:16GiB,1GiB:2GiB:1TiB", 0) == [
        Capacity(4 << 30, 16 << 30, 0), Capacity(1 << 30, 2 << 30, 1 << 40)]
    for bad in ("4GiB", "x:y", "1:2:3:4"):
        with pytest.raises(InvalidInput):
            parse_capacities(bad, 0)


def test_a_size_too_large_for_int64_is_refused() -> None:
    # '1e400' is inf as a float: int(inf) raised OverflowError out of `kvstore bench workload`.
    for bad in ("1e400", "1e400GiB", "1e19", "9e6TiB"):
        with pytest.raises(InvalidInput, match="too large a size"):
            parse_size(bad)
    with pytest.raises(InvalidInput, match="'1e400' is too large a size"):
        parse_capacities("1e400:1GiB", 0)
    assert parse_size("8EB".replace("EB", "e18")) == 8 * 10**18  # below 2**63 - 1: still taken


def test_the_largest_size_is_taken_and_whole_numbers_are_exact() -> None:
    # Through a float, 2**63 - 1 became 2**63 and was refused as too large; 2**53 + 1 became 2**53.
    assert parse_size("9223372036854775807") == (1 << 63) - 1
    assert parse_size("9007199254740993") == (1 << 53) + 1
    assert parse_size("8388607TiB") == 8388607 << 40 and parse_size("0009B") == 9
    for bad in ("9223372036854775808", "8388608TiB", "9" * 5000):
        with pytest.raises(InvalidInput, match="too large a size"):
            parse_size(bad)


def test_sweep_concurrencies_have_the_bound_of_the_scale_flags() -> None:
    # 1,000,000 ran out of memory after 36 s; --sessions and --concurrency stop at 100,000.
    assert parse_concurrencies("8,100000") == [8, 100_000]
    for bad, said in (("8,1000000", "got 1,000,000"), ("0", "got 0"), ("", "integers >= 1")):
        with pytest.raises(InvalidInput, match=said):
            parse_concurrencies(bad)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    add_workload_arguments(p)
    return p.parse_args(["--json", *argv])


SMALL = ("--sessions", "6", "--concurrency", "3", "--turns", "4", "--context-tokens", "8192",
         "--system-tokens", "1024", "--output-tokens", "64", "--tenants", "2")


def test_bench_json_output_contract(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    md = tmp_path / "tables.md"
    out = run_workload_bench(_args(*SMALL, "--trace", str(trace), "--markdown", str(md)))
    json.dumps(out, allow_nan=True)  # serialisable as the dispatcher prints it
    assert out["mode"] == "simulated"
    assert {"cold", "warm", "expired"} <= set(out["cases"])
    assert sum(out["cases"][c]["count"] for c in ("cold", "warm", "expired")) == 24
    for key in ("hit_rate_by_tier", "bills_per_request", "persistent_bytes_ratio_vs_baseline",
                "global_bytes_per_token"):
        assert key in out
    assert 0.12 < out["persistent_bytes_ratio_vs_baseline"] < 0.2
    assert out["global_bytes_per_token"] == pytest.approx(890.0)
    records = list(read_trace(trace))
    assert len(records) == 24 and {r.local_outcome for r in records} <= {"cold", "hit", "replayed", "absent"}
    assert "| case |" in md.read_text()


def test_bench_sweep_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "cliff.png"
    out = run_workload_bench(_args(*SMALL, "--sweep", "--sweep-concurrency", "2,4,8",
                                   "--sweep-capacities", "64MiB:256MiB,128MiB:512MiB", "--plot", str(png)))
    assert [set(c) >= {"capacity_bytes", "cliff_concurrency"} for c in out["cliff"]] == [True, True]
    assert out["cliff"][0]["capacity_bytes"] == 320 * MiB
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *a: Any, **kw: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(InvalidInput, match=r"kvstore\[plot\]"):
        run_workload_bench(_args(*SMALL, "--sweep", "--sweep-concurrency", "2",
                                 "--sweep-capacities", "64MiB:256MiB", "--plot", str(tmp_path / "x.png")))
    with pytest.raises(InvalidInput, match="--sweep"):
        run_workload_bench(_args(*SMALL, "--plot", str(tmp_path / "x.png")))
