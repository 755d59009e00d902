"""Every bench prints alike: readable text on stdout (its tables, or its figures one per line),
progress on stderr, JSON with `--json`; so `> file` keeps what was asked for."""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvstore.bench import restart
from kvstore.bench.abuse import _summary as abuse_summary
from kvstore.bench.names import names_note
from kvstore.bench.restart import _loading_figures
from kvstore.cli import main
from kvstore.commands.bench import _print_human
from kvstore.layout import get_model
from kvstore.store import GlobalStore

SMALL = ["bench", "workload", "--sessions", "6", "--turns", "3"]
RAW_JSON = re.compile(r"^\s*\S+\s+[\[{]\"?")  # a `key {json}` line


def test_bench_workload_tables_go_to_stdout_and_progress_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SMALL) == 0
    out = capsys.readouterr()
    assert "| case | requests |" in out.out and "## simulated run" in out.out
    assert not [line for line in out.out.splitlines() if RAW_JSON.match(line)], out.out
    assert "bench workload:" in out.err and "| case |" not in out.err
    assert main([*SMALL, "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert "tables" not in doc and doc["mode"] == "simulated"


def test_figures_without_tables_print_one_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    _print_human({"model": "m", "lookup": {"p50_ms": 0.25, "tiers": {"dram": 3}}, "sizes": [1, 2],
                  "runs": [{"ms": 1.5}], "targets": [{"name": "t", "value": 0.5, "target": "<= 1", "ok": True}]})
    out = capsys.readouterr().out
    assert "lookup.p50_ms" in out and "lookup.tiers.dram" in out and "runs[0].ms" in out and "1, 2" in out
    assert not [line for line in out.splitlines() if RAW_JSON.match(line)], out
    assert "[ok  ] t: 0.5 (target <= 1)" in out


def test_bench_dataplane_reports_each_path_what_a_load_costs_besides_its_copy_and_first_loads(
        capsys: pytest.CaptureFixture[str]) -> None:
    # A small run of the real bench: its own `kvstore serve` on TCP and a Unix socket, two loading
    # client processes. It checks the loaded bytes itself; here, that every figure came out.
    assert main(["bench", "dataplane", "--json", "--sections", "host,first,runner", "--prefixes", "1024",
                 "--repeats", "2", "--clients", "2", "--store-repeats", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["machine"]["cpus"] == os.cpu_count() and doc["machine"]["cpu"], doc["machine"]
    f = doc["prefixes"]["1024"]
    for key in ("memcpy_gbps", "memcpy_threads_gbps", "shm_load_gbps", "shm_load_1_thread_gbps", "grpc_load_gbps",
                "shm_load_4_clients_gbps", "memcpy_4_clients_gbps", "shm_load_1_client_gbps"):
        assert f[key] > 0, (key, f)
    assert 1 <= f["copy_threads"] <= 4, f
    assert f["shm_control_ms"] > 0, f  # a figure, never compared here: tests do not time things
    first = doc["first_load"]  # a new session's first load from LMDB, with and without a prefaulted segment
    for key in ("prefaulted_first_load_ms", "prefaulted_second_load_ms", "not_prefaulted_first_load_ms",
                "not_prefaulted_second_load_ms"):
        assert first[key] > 0, (key, first)
    snap = doc["snapshot"]  # the local snapshot through the load segment and through messages
    assert snap["snapshot_bytes"] > 0 and all(snap[f"{p}_{c}_ms"] > 0 for p in ("shm", "grpc")
                                              for c in ("store_local", "load_local", "resume")), snap
    runner = doc["runner"]  # expired Resumes whose replay jobs went to a runner on each path (checked there)
    assert runner["passes"] == 2 and all(runner[f"{p}_replay_resume{m}_ms"] > 0 for p in ("shm", "grpc")
                                         for m in ("", "_median")), runner
    assert "`4_clients` stands for 4 (--clients 2 in this run)" in doc["names_note"], doc.get("names_note")
    assert doc["shm_in_place_share"] == 1.0 and {t["name"].split(": ")[1].split(" (")[0] for t in doc["targets"]} == {
        "shm_load_gbps / memcpy_threads_gbps", "shm_load_gbps / grpc_load_gbps",
        "shm_load_4_clients_gbps / shm_load_1_client_gbps"}


def test_bench_restart_reports_what_a_reopen_and_the_lookups_during_a_background_load_cost(
        capsys: pytest.CaptureFixture[str]) -> None:
    # A small run of the real bench (fresh processes writing and reopening real data dirs). The
    # bench checks that every reopen found every chunk and that the background-loaded index hits
    # the whole first prompt; here, that every figure came out.
    assert main(["bench", "restart", "--json", "--toy-chunks", "256", "512", "--v41-chunks", "256"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for case in ("toy_10k", "toy_200k", "v41_10k"):
        f = doc[case]
        assert f["reopen_cold_seconds"] > 0 and f["reopen_warm_seconds"] > 0 and f["index_bytes_per_chunk"] > 0, f
        assert f["background_index_seconds"] > 0 and f["lookup_p99_ms_ready"] > 0, f
        assert f["background_open_seconds"] > 0, f
        if f["lookups_while_loading"]:  # a small index may load before the first Lookup is done
            assert f["lookup_max_ms_while_loading"] >= f["lookup_p99_ms_while_loading"] > 0, f
            assert f["lookup_loading_ratio"] > 0, f
        else:
            assert f["lookup_p99_ms_while_loading"] is None and f["lookup_loading_ratio"] is None, f


@pytest.mark.timeout(120)
def test_an_index_load_that_fails_ends_the_restart_bench_with_its_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The bench waited for `ready`, which a failed load never sets: it hung until killed.
    def failing(self: GlobalStore) -> None:
        raise OSError(5, "Input/output error")

    spec = get_model("reference-toy-8")
    store = GlobalStore(restart._config(4, spec), tmp_path, [spec])
    restart._write(store, spec, 4)
    store.close()
    monkeypatch.setattr(GlobalStore, "_load_index", failing)
    with pytest.raises(RuntimeError, match="index did not load: failed: OSError"):
        restart._lookups_while_loading(str(tmp_path), spec.name, 4)


def test_a_p99_of_fewer_than_100_lookups_while_the_index_loads_is_marked_n_lt_100() -> None:
    # One Lookup while loading gave a "p99" that was that Lookup, unmarked.
    one = _loading_figures([0.002], [0.001] * 200, 0.5)
    assert one["lookup_p99_ms_while_loading"] == pytest.approx(2.0) and one["lookups_while_loading"] == 1
    assert one["lookup_p99_while_loading_note"].startswith("n<100: 1 Lookups")
    assert "lookup_p99_while_loading_note" not in _loading_figures([0.002] * 100, [0.001] * 200, 0.5)
    assert "lookup_p99_while_loading_note" not in _loading_figures([], [0.001] * 200, 0.5)  # nulls say it


def test_an_abuse_run_whose_victim_calls_all_failed_writes_valid_json(capsys: pytest.CaptureFixture[str]) -> None:
    # The p99 of a pass with no successful call is NaN; `--json` wrote NaN, which JSON does not have.
    nan = float("nan")
    failed = {"victim_p99_ms_alone": nan, "victim_p99_ms": nan, "victim_errors": 800,
              "victim_error_codes": ["UNAVAILABLE"], "p99_ratio": nan, "rss_before_bytes": 1,
              "rss_during_bytes": 1, "rss_growth_bytes": 0, "rss_settle_seconds": 0.0, "threads_before": 1,
              "threads_during": 1, "settled": True, "abuser": {}}
    doc = json.loads(json.dumps(abuse_summary({"store_flood": failed}, [nan]), allow_nan=False))
    assert doc["victim_p99_ms_alone"] is None and doc["abuses"]["store_flood"]["p99_ratio"] is None
    assert [(t["name"], t["ok"]) for t in doc["targets"]] == [("store_flood: victim errors", False),
                                                             ("store_flood: RSS growth MiB", True)]
    _print_human(doc)  # and the checklist still prints
    assert "[MISS] store_flood: victim errors: 800" in capsys.readouterr().out


def test_names_that_carry_a_default_size_say_so_when_the_flag_differs() -> None:
    sizes = {"tokens": ("32k", 32_768), "long_tokens": ("1m", 1_000_000)}
    assert names_note(argparse.Namespace(tokens=32_768, long_tokens=1_000_000), sizes) == {}
    note = names_note(argparse.Namespace(tokens=1024, long_tokens=1_000_000), sizes)["names_note"]
    assert note.endswith("`32k` stands for 32,768 (--tokens 1,024 in this run)"), note


@pytest.mark.parametrize(("argv", "said"), [
    (["bench", "store", "--sections", "nope"], "store: --sections takes some of memory,lmdb,lookup,device, not 'nope'"),
    # NaN passed the `< 0` checks: an AssertionError, an OverflowError or NaN figures followed.
    ([*SMALL, "--cost", "lookup_seconds=nan"], "cost model 'lookup_seconds' must be a finite number"),
    ([*SMALL, "--cost", "gpu_flops=inf"], "cost model 'gpu_flops' must be a finite number"),
    ([*SMALL, "--mode", "live", "--target", "127.0.0.1:1", "--time-scale", "nan"],
     "--time-scale must be a finite number > 0"),
    (["bench", "replay", "--prefixes", "100"], "replay: --prefixes must be positive multiples of 128"),
    (["bench", "restart", "--toy-chunks", "10", "20"], "restart: every case needs at least"),
    # A ValueError from numpy (a negative tail) and an AssertionError from the part encoder.
    (["bench", "store", "--sections", "lookup", "--lookup-tokens", "4096"],
     "store: --lookup-tokens must be at least 8192"),
    (["bench", "pool", "--part-bytes", "0"], "pool: --part-bytes must be in 4096..536870912"),
])
def test_a_bad_bench_argument_is_a_one_line_user_error(argv: list[str], said: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # It was a SystemExit: status 1 and no "kvstore bench:" before the message.
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvstore bench: {said}") and err.count("\n") == 1


def test_the_lookups_timed_while_the_index_loads_do_the_work_of_those_timed_once_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The case's first prompt was timed on both sides: while the index loaded (in key order, about
    # random) its walk stopped at chunk 0-5, once loaded it hit all 256 chunks, and the ratio
    # divided one by the other. In process here, over a real data dir.
    case = restart.Case("toy", "reference-toy-8", 2 * restart.CHUNKS_PER_PROMPT)
    restart._fill(str(tmp_path), case)
    index_batch, lookup = GlobalStore._index_batch, GlobalStore.lookup
    looked = threading.Event()

    def lookup_seen(self: GlobalStore, *a: Any, **k: Any) -> Any:
        looked.set()
        return lookup(self, *a, **k)

    def slow(self: GlobalStore, *a: Any, **k: Any) -> None:
        # The fault: a slow loader, so that Lookups come while it loads. Held until the first came:
        # 0.1 s alone was over before a loaded machine's caller reached its first Lookup.
        looked.wait(30)
        time.sleep(0.1)
        index_batch(self, *a, **k)

    monkeypatch.setattr(GlobalStore, "lookup", lookup_seen)
    monkeypatch.setattr(GlobalStore, "_index_batch", slow)
    f = restart._lookups_while_loading(str(tmp_path), case.model, case.chunks)
    assert f["lookups_while_loading"] > 0 and f["lookup_p99_ms_while_loading"] is not None, f
    assert f["lookup_hit_chunks_while_loading"] == f["lookup_hit_chunks_ready"] == [0], f
    assert f["full_hit_chunks"] == [restart.CHUNKS_PER_PROMPT] and f["full_hit_lookup_p99_ms_ready"] > 0, f


def test_restart_refuses_a_v41_case_of_another_size_than_the_small_toy_case(
        capsys: pytest.CaptureFixture[str]) -> None:
    # "cold reopen 10K V4.1 <= 1.5 x 10K toy" divided a reopen of --v41-chunks chunks by one of the
    # small --toy-chunks, whatever both were: 256 V4.1 chunks against 2,000 toy ones read [ok].
    assert main(["bench", "restart", "--toy-chunks", "256", "512", "--v41-chunks", "512"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstore bench: restart: --v41-chunks (512) must equal the small --toy-chunks (256)"), err
    assert err.count("\n") == 1


def test_restart_names_carry_the_default_sizes_and_say_so_in_a_run_of_others() -> None:
    # toy_10k, toy_200k and v41_10k were kept whatever the flags, with no note.
    assert names_note(argparse.Namespace(toy_chunks=(10_000, 200_000)), restart.NAMED_SIZES) == {}
    note = names_note(argparse.Namespace(toy_chunks=[256, 200_000]), restart.NAMED_SIZES)["names_note"]
    assert note.endswith("`10k` stands for 10,000 (--toy-chunks 256 200,000 in this run)"), note
    note = names_note(argparse.Namespace(toy_chunks=[256, 512]), restart.NAMED_SIZES)["names_note"]
    assert "`200k` stands for 200,000 (--toy-chunks 256 512 in this run)" in note, note


def test_bench_dataplane_reports_the_bytes_of_the_timed_replay_jobs(capsys: pytest.CaptureFixture[str]) -> None:
    # `job_bytes` read n_chunks x chunk_bytes: the untimed warm-up pass's job, while timed pass i
    # (its boundary i chunks short, so that no replay is shared) carries n_chunks - i chunks.
    assert main(["bench", "dataplane", "--json", "--sections", "runner", "--prefixes", "1024", "--repeats", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    cb, ct = doc["chunk_bytes"], get_model(doc["model"]).layout.chunk_tokens
    runner = doc["runner"]
    assert runner["passes"] == 3 and runner["tokens"] == 1024, runner
    assert runner["job_bytes"] == [(1024 // ct - i) * cb for i in (1, 2, 3)], (runner["job_bytes"], cb)
