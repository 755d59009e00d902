"""The host memory a start plans against what the process may take: the memory cgroup's limit (v1
or v2, read from a fake /proc and /sys/fs/cgroup tree), what the process already uses, and
MemAvailable. `kvstore serve` refuses, in one line naming the keys and exit 2, host arenas it would
back at start beyond that (it listened, then the kernel killed it seconds later), and warns in one
line about what grows with use (the embedded pool here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstore.config.store import StoreConfig
from kvstore.tiers.factory import host_arenas
from kvstore.tiers.host_memory import HostMemory, HostNeed, judge, read_host_memory
from tests.fixtures.service import LISTENING, base_table, to_toml

MiB = 1 << 20
UNLIMITED_V1 = 9223372036854771712


def fake_host(root: Path, cgroup_lines: str, files: dict[str, str], rss_kib: int = 40 * 1024,
              available_kib: int = 64 << 20) -> tuple[Path, Path]:
    """A /proc and a /sys/fs/cgroup under `root`: `files` are cgroup files by path under the latter."""
    proc, cg = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    (proc / "self" / "status").write_text(f"Name:\tpython\nVmPeak:\t 999999 kB\nVmRSS:\t  {rss_kib} kB\n")
    (proc / "meminfo").write_text(f"MemTotal:  {2 * available_kib} kB\nMemAvailable:  {available_kib} kB\n")
    for rel, text in files.items():
        (cg / rel).parent.mkdir(parents=True, exist_ok=True)
        (cg / rel).write_text(text)
    return proc, cg


def test_v2_limit_is_the_least_along_the_ancestors(tmp_path: Path) -> None:
    proc, cg = fake_host(tmp_path, "0::/kube/pod/kvs\n", {
        "memory.max": "max\n", "kube/memory.max": f"{700 * MiB}\n", "kube/pod/memory.max": f"{900 * MiB}\n",
        "kube/pod/kvs/memory.max": "max\n"})
    host = read_host_memory(proc, cg)
    assert host.limit_bytes == 700 * MiB and host.limit_file == str(cg / "kube" / "memory.max")
    assert host.used_bytes == 40 * MiB and host.available_bytes == 64 << 30
    bound = host.headroom()
    assert bound is not None and bound[0] == 660 * MiB


def test_v1_memory_controller_and_unlimited(tmp_path: Path) -> None:
    lines = "12:cpu,cpuacct:/\n4:memory:/hl2\n0::/\n"
    proc, cg = fake_host(tmp_path / "a", lines, {
        "memory/memory.limit_in_bytes": f"{UNLIMITED_V1}\n", "memory/hl2/memory.limit_in_bytes": f"{700 * MiB}\n"})
    assert read_host_memory(proc, cg).limit_bytes == 700 * MiB
    proc, cg = fake_host(tmp_path / "b", lines, {
        "memory/memory.limit_in_bytes": f"{UNLIMITED_V1}\n", "memory/hl2/memory.limit_in_bytes": f"{UNLIMITED_V1}\n"})
    host = read_host_memory(proc, cg)
    assert host.limit_bytes is None
    assert host.headroom() == (64 << 30, "the host's MemAvailable of 65,536.0 MiB")


def test_a_host_path_not_under_the_mount_reads_the_mount_root(tmp_path: Path) -> None:
    # A container without a cgroup namespace: /proc says the host's path, its own cgroup is the root.
    proc, cg = fake_host(tmp_path, "0::/docker/0123abcd\n", {"memory.max": f"{512 * MiB}\n"})
    assert read_host_memory(proc, cg).limit_bytes == 512 * MiB


def test_nothing_readable_is_unknown(tmp_path: Path) -> None:
    host = read_host_memory(tmp_path / "no-proc", tmp_path / "no-cgroup")
    assert host == HostMemory(None, "", 0, None) and host.headroom() is None
    assert judge([HostNeed(("store.dram_capacity_bytes",), 1 << 40, "store.prefault_arenas")], host).refusal == ""


def test_judge_refuses_what_is_backed_at_start_and_warns_about_what_grows() -> None:
    host = HostMemory(700 * MiB, "memory.max", 300 * MiB, 64 << 30)
    dram = HostNeed(("store.dram_capacity_bytes",), 1536 * MiB, "store.prefault_arenas")
    pool = HostNeed(("local_pool.capacity_bytes",), 512 * MiB)
    refused = judge([dram, pool], host)
    assert refused.refusal.startswith(f"store.dram_capacity_bytes = {1536 * MiB}: cannot allocate")
    assert not refused.warning
    assert "lower store.dram_capacity_bytes" in refused.refusal and "400.0 MiB" in refused.refusal
    assert "\n" not in refused.refusal
    lazy = judge([HostNeed(("store.dram_capacity_bytes",), 1536 * MiB), pool], host)
    assert not lazy.refusal and "store.dram_capacity_bytes or local_pool.capacity_bytes" in lazy.warning
    small = HostNeed(("store.dram_capacity_bytes",), 128 * MiB, "store.prefault_arenas")
    warned = judge([small, pool], host)
    assert not warned.refusal and "lower local_pool.capacity_bytes" in warned.warning
    assert judge([small, HostNeed(("local_pool.capacity_bytes",), 64 * MiB)], host).warning == ""



def test_judge_only_warns_where_the_hosts_available_memory_is_the_bound() -> None:
    # No cgroup limit: the host may swap or free memory, and nothing kills this process for it.
    host = HostMemory(None, "", 300 * MiB, 1024 * MiB)
    dram = HostNeed(("store.dram_capacity_bytes",), 1536 * MiB, "store.prefault_arenas")
    said = judge([dram], host)
    assert not said.refusal and "MemAvailable" in said.warning and "lower store.dram_capacity_bytes" in said.warning


def test_host_arenas_are_dram_and_a_host_device_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = StoreConfig(device="auto", device_capacity_bytes=64 * MiB, dram_capacity_bytes=1536 * MiB)
    assert host_arenas(cfg, split=False) == [
        HostNeed(("store.dram_capacity_bytes",), 1536 * MiB, "store.prefault_arenas"),
        HostNeed(("store.device_capacity_bytes",), 64 * MiB, "store.prefault_arenas")]
    lazy = StoreConfig(device="cuda", prefault_arenas=False)
    assert host_arenas(lazy, split=False) == [HostNeed(("store.dram_capacity_bytes",), lazy.dram_capacity_bytes)]
    # Beside CUDA the DRAM arena is pinned (backed when allocated), unless it is split between tenants.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [n.backed_by for n in host_arenas(lazy, split=False)] == ["pinned"]
    assert [n.backed_by for n in host_arenas(lazy, split=True)] == [""]


# `kvstore serve` reading the fake tree named by FAKE_PROC and FAKE_CGROUP.
SERVE_ON_FAKE_HOST = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "import kvstore.tiers.host_memory as hm\n"
    "hm.PROC, hm.CGROUP_ROOT = Path(os.environ['FAKE_PROC']), Path(os.environ['FAKE_CGROUP'])\n"
    "from kvstore.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def serve_on_fake_host(tmp_path: Path, store: dict[str, object], pool_bytes: int) -> tuple[int | None, list[str]]:
    """Start `kvstore serve` under a fake 96 MiB cgroup (40 MiB used); its exit status (None: it
    listened, and was stopped) and its output lines."""
    proc, cg = fake_host(tmp_path / "host", "0::/kvs\n", {"kvs/memory.max": f"{96 * MiB}\n"})
    table = base_table(store=store, local_pool={"capacity_bytes": pool_bytes})
    (tmp_path / "kvstore.toml").write_text(to_toml(table))
    env = dict(os.environ, PYTHONUNBUFFERED="1", FAKE_PROC=str(proc), FAKE_CGROUP=str(cg))
    p = subprocess.Popen(
        [sys.executable, "-c", SERVE_ON_FAKE_HOST, "serve", "--config", str(tmp_path / "kvstore.toml"),
         "--grpc-port", "0", "--admin-port", "-1", "--data-dir", str(tmp_path / "data"), "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert p.stdout is not None
    lines: list[str] = []
    try:
        for line in p.stdout:
            lines.append(line.rstrip("\n"))
            if LISTENING.search(line):
                p.terminate()
                p.wait(60)
                return None, lines
        return p.wait(60), lines
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_serve_refuses_arenas_backed_at_start_beyond_the_cgroup_limit(tmp_path: Path) -> None:
    rc, lines = serve_on_fake_host(tmp_path, {"dram_capacity_bytes": 64 * MiB, "prefault_arenas": True}, 1 << 20)
    assert rc == 2, lines
    said = [line for line in lines if "store.dram_capacity_bytes" in line]
    assert len(said) == 1 and said[0].startswith(f"kvstore serve: store.dram_capacity_bytes = {64 * MiB}: "
                                                 "cannot allocate"), lines
    assert "memory cgroup's limit of 96.0 MiB" in said[0] and "lower store.dram_capacity_bytes" in said[0]
    assert not any("arenas: backing" in line for line in lines)  # refused before anything was allocated
    assert not (tmp_path / "data" / "lmdb").exists()


def test_serve_warns_about_a_pool_that_would_outgrow_the_limit(tmp_path: Path) -> None:
    rc, lines = serve_on_fake_host(tmp_path, {"prefault_arenas": True}, 64 * MiB)
    assert rc is None, lines  # it listened
    warned = [line for line in lines if "grows with use" in line]
    assert len(warned) == 1 and "lower local_pool.capacity_bytes" in warned[0], lines


def _config_on_fake_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **sections: dict[str, object]) -> Path:
    """A config file of these sections, read by check-config in this process as if on a host whose
    memory cgroup allows 96 MiB (40 MiB used)."""
    import kvstore.tiers.host_memory as hm

    proc, cg = fake_host(tmp_path / "host", "0::/kvs\n", {"kvs/memory.max": f"{96 * MiB}\n"})
    monkeypatch.setattr(hm, "PROC", proc)
    monkeypatch.setattr(hm, "CGROUP_ROOT", cg)
    path = tmp_path / "kvstore.toml"
    path.write_text(to_toml(base_table(**sections)))
    return path


def test_check_config_says_what_serve_would_refuse_on_this_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # check-config said "valid" with no word of it; serve then refused at start.
    from kvstore.cli import main

    path = _config_on_fake_host(tmp_path, monkeypatch, store={"dram_capacity_bytes": 64 * MiB, "prefault_arenas": True},
                                local_pool={"capacity_bytes": 1 << 20})
    assert main(["check-config", str(path)]) == 0  # the config may be meant for another host
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if "store.dram_capacity_bytes" in line]
    assert len(said) == 1 and "cannot allocate" in said[0] and "refuses to start if so there" in said[0], err
    assert main(["check-config", "--json", str(path)]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert sum("memory cgroup's limit of 96.0 MiB" in w for w in warnings) == 1, warnings

    path.write_text(to_toml(base_table(store={"dram_capacity_bytes": 8 * MiB, "prefault_arenas": True},
                                       local_pool={"capacity_bytes": 1 << 20})))
    assert main(["check-config", "--json", str(path)]) == 0
    assert not [w for w in json.loads(capsys.readouterr().out)["warnings"] if "memory" in w]


def test_check_config_counts_the_segments_of_the_socket_serve_will_be_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A socket given on serve's command line (--unix-socket) brings same-host segments that
    # check-config, judging the file alone, never counted.
    from kvstore.cli import main

    path = _config_on_fake_host(tmp_path, monkeypatch, store={"dram_capacity_bytes": 8 * MiB},
                                local_pool={"capacity_bytes": 1 << 20}, service={"max_shm_sessions": 8})

    def warnings(*flags: str) -> list[str]:
        assert main(["check-config", "--json", *flags, str(path)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["settings"]["service"]["unix_socket_path"] == (flags[1] if flags else "")
        return [w for w in out["warnings"] if "same-host segments" in w]

    assert warnings() == []
    (said,) = warnings("--unix-socket", "/run/kvstore/kvstore.sock")
    assert "service.max_shm_sessions" in said and "96.0 MiB" in said, said
    assert main(["check-config", "--unix-socket", "run/kvstore.sock", str(path)]) == 2
    assert capsys.readouterr().err.strip() == ("kvstore check-config: --unix-socket must be an absolute path "
                                               "(or empty for none)")
    assert main(["check-config", "--unix-socket", "/" + "x" * 120, str(path)]) == 2
    assert "--unix-socket must be at most 100 bytes" in capsys.readouterr().err
