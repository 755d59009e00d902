"""What machine a benchmark ran on, printed with its figures: runs on different CPUs compare
only by their ratios, and vLLM's CPU kernels take other paths where AVX-512 or AMX exist."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The instruction sets that change what the benchmarks' kernels do (numpy, torch, vLLM on CPU).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine() -> dict[str, object]:
    """CPU model, core count and the FLAGS the CPU has (Linux; elsewhere what platform knows)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "cpu_flags": [f for f in FLAGS if f in flags]}
