"""Ports the flags give `kvstore serve` meet the config's rule that gRPC and the admin port differ
on one address: before, `--grpc-port P` with the config's `admin.port = P` (or `--admin-port P`)
passed, gRPC started and served, and the admin port's bind then failed, blamed on another process
("Address already in use")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.local_pool.redis_process import free_port

SMALL = ('[store]\nprefault_arenas = false\ndevice = "cpu"\ndevice_capacity_bytes = 1048576\n'
         'dram_capacity_bytes = 1048576\n[replay]\nrunner = "none"\n')


@pytest.mark.parametrize("where", ["flags", "config"])
def test_one_port_for_grpc_and_admin_is_one_line_before_anything_binds(tmp_path: Path, where: str) -> None:
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(SMALL + (f"[admin]\nport = {port}\n" if where == "config" else ""))
    argv = ["serve", "--config", str(cfg), "--data-dir", str(tmp_path / "data"), "--grpc-port", str(port)]
    if where == "flags":
        argv += ["--admin-port", str(port)]
    out = subprocess.run([sys.executable, "-m", "kvstore", *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert out.stderr.count("\n") == 1 and f"would both be {port}" in out.stderr, out.stderr
    assert "already in use" not in out.stderr and not (tmp_path / "data").exists()  # refused before anything opened
