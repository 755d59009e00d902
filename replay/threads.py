"""How many CPU threads the model gets: `replay.threads`, resolved for this machine and applied.

The reference model's matrices are small: a second intra-op thread mostly waits, and on a busy
machine it waits for a core another process holds. Torch's default (one thread per core) made a
6,000-token prefill range 0.3-7.3 s on a shared 2-core machine, against 0.46-0.50 s on one thread,
so every place the model runs (the in-process runner, the runner process, the demo, the benches)
sets its thread count here, deliberately. The setting is process-wide (torch keeps one pool).
"""

from __future__ import annotations

import os

MAX_AUTO_THREADS = 4


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def resolve_threads(setting: int) -> int:
    """`setting` threads, or for 0 ("auto") one thread per four usable CPUs, 1 to 4: small models
    gain little from more, and the rest of the machine keeps cores for the service and the engine."""
    if setting > 0:
        return setting
    return max(1, min(MAX_AUTO_THREADS, usable_cpus() // 4))


def use_threads(setting: int) -> int:
    """Give torch `resolve_threads(setting)` intra-op threads; returns the number set."""
    import torch  # only where the model runs

    n = resolve_threads(setting)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
