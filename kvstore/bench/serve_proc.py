"""`kvstore serve` in a child process, as deployed, for the benchmarks that measure the service."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvstore.local_pool.redis_process import die_with_parent


def start_serve(config: Path, data_dir: Path, admin: bool = False) -> tuple[subprocess.Popen[str], str]:
    """Start it on a free port; (the process, its gRPC address) once its banner says it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--config", str(config), "--grpc-port", "0",
         "--admin-port", "0" if admin else "-1", "--data-dir", str(data_dir), "--log-level", "warning"],
        stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent())  # no orphan if the bench is killed
    assert proc.stdout is not None
    for line in proc.stdout:
        if "gRPC listening on" in line:
            return proc, line.split("listening on ", 1)[1].split()[0]
    raise RuntimeError(f"kvstore serve exited with {proc.wait()} before listening")
