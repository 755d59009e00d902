"""`kvstore bench service` runs end to end on a small prefix and keeps its output contract (the
issue's JSON keys, a target per line). Its figures are not judged here: speed lives in the
benchmark's own runs (BENCHMARKS.md), never in tests."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_service_bench_runs_and_reports_every_figure_and_target() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "service", "--json", "--tokens", "1024", "--repeats", "1",
         "--lookups", "5", "--clients", "1", "--large-tokens", "2048", "--long-tokens", "20000",
         "--long-lookups", "2"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    for key in ("load_gbps", "raw_stream_gbps", "lookup_32k_p50_ms", "lookup_32k_p99_ms", "raw_unary_32k_p50_ms",
                "concurrent_load_gbps", "lookup_32k_unmemoized_p50_ms", "lookup_32k_admin_on_p50_ms",
                "load_into_128k_gbps", "load_128k_gbps", "raw_stream_128k_gbps", "load_128k_ratio",
                "lookup_1m_first_sight_p50_ms", "raw_unary_1m_first_sight_run_p50_ms", "lookup_1m_first_sight_ratio",
                "lookup_1m_miss_p50_ms", "lookup_1m_miss_admin_on_p50_ms", "lookup_1m_miss_admin_on_ratio"):
        assert isinstance(doc[key], float) and doc[key] > 0, key
    assert doc["prefix_tokens"] == 1024 and doc["key_chain_kernel"] in ("openssl", "hashlib")
    names = [t["name"] for t in doc["targets"]]
    assert doc["long_lookup_tokens"] == 20000
    # The names are the defaults' (the keys above), and the run says so.
    assert all(f"`{word}` stands for" in doc["names_note"] for word in ("32k", "128k", "1m")), doc["names_note"]
    assert len(names) == 6 and "lookup_1m_first_sight_ratio" in names[5]
    assert all(isinstance(t["ok"], bool) for t in doc["targets"])
