"""The host memory a start plans, against what this process may still take.

What it may take: the memory cgroup's limit (v2 `memory.max`, v1 `memory.limit_in_bytes`, the
least along the cgroup's ancestors) less what the process already holds (VmRSS), and the host's
MemAvailable. Past the limit the kernel kills the process, minutes or seconds after it listened
(a crash loop under a restart policy), so the plan is compared before anything is allocated.
`read_host_memory` reads under `PROC` and `CGROUP_ROOT`, which a test points at a fake tree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# A v1 cgroup without a limit reads PAGE_COUNTER_MAX pages (9223372036854771712 with 4 KiB pages).
NO_LIMIT_FROM_BYTES = 1 << 60


def mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


@dataclass(frozen=True)
class HostMemory:
    limit_bytes: int | None  # the memory cgroup's limit; None: none
    limit_file: str  # where the limit was read
    used_bytes: int  # this process's resident memory
    available_bytes: int | None  # the host's MemAvailable; None: unknown

    def limit_room(self) -> tuple[int, str] | None:
        """What the memory cgroup still lets this process take, in words; None: no limit known.
        Past it the process is killed, whatever the host has free."""
        if self.limit_bytes is None:
            return None
        return (max(0, self.limit_bytes - self.used_bytes),
                f"the memory cgroup's limit of {mib(self.limit_bytes)} in {self.limit_file} less the "
                f"{mib(self.used_bytes)} it already uses")

    def headroom(self) -> tuple[int, str] | None:
        """The most this process may still take without pressing on the host, and what bounds it
        in words: the cgroup's room or the host's MemAvailable, the lower; None: unknown."""
        bounds = [b for b in (self.limit_room(),) if b is not None]
        if self.available_bytes is not None:
            bounds.append((self.available_bytes, f"the host's MemAvailable of {mib(self.available_bytes)}"))
        return min(bounds, key=lambda b: b[0]) if bounds else None


@dataclass(frozen=True)
class HostNeed:
    """Host memory the start plans: the config keys that size it, how much, `backed_by`: what
    backs it at start ("store.prefault_arenas", "pinned") or "" for memory that grows with use,
    and `what`: how it is said where it is more than the first key."""

    keys: tuple[str, ...]
    nbytes: int
    backed_by: str = ""
    what: str = ""


@dataclass(frozen=True)
class Verdict:
    refusal: str = ""  # the memory backed at start does not fit: the start is refused
    warning: str = ""  # all of it does not fit, but what does not grows with use


def _listed(needs: list[HostNeed]) -> str:
    return ", ".join(f"{n.what or n.keys[0]} {mib(n.nbytes)}" for n in needs)


def judge(needs: Iterable[HostNeed], host: HostMemory) -> Verdict:
    """What is backed at start must fit in the memory cgroup's room, else the process is killed
    right after it listens: refused. Past the host's MemAvailable it is warned about (the host may
    swap or free memory; other processes come and go), as is what grows with use (an arena not
    prefaulted, the embedded pool, same-host segments): the service runs until it fills them."""
    bound = host.headroom()
    needs = [n for n in needs if n.nbytes > 0]
    if bound is None:
        return Verdict()
    room, why = bound
    now = [n for n in needs if n.backed_by]
    later = [n for n in needs if not n.backed_by]
    at_start = sum(n.nbytes for n in now)
    limit = host.limit_room()
    if limit is not None and at_start > limit[0]:
        biggest = max(now, key=lambda n: n.nbytes)
        backed = sorted({n.backed_by for n in now})
        # Said as an arena the OS refuses is ("key = value: cannot allocate ...").
        return Verdict(
            refusal=f"{biggest.keys[0]} = {biggest.nbytes}: cannot allocate {mib(at_start)} of host memory backed "
                    f"at start ({' and '.join(backed)}: {_listed(now)}) within the {mib(limit[0])} this process may "
                    f"take, {limit[1]}; it would be killed for want of memory soon after it listens: lower "
                    f"{' or '.join(k for n in now for k in n.keys)}, or raise the limit")
    if at_start > room:
        return Verdict(warning=(
            f"host memory: {mib(at_start)} backed at start ({_listed(now)}) is more than {why}: the host "
            f"will swap or kill for it: lower {' or '.join(k for n in now for k in n.keys)}"))
    grows = sum(n.nbytes for n in later)
    if at_start + grows > room:
        return Verdict(warning=(
            f"host memory: what grows with use ({_listed(later)}), {mib(grows)}, is more than this process may "
            f"take after {mib(at_start)} backed at start, {mib(room - at_start)} of {mib(room)}: {why}; it "
            f"starts, and may be killed for want of memory once they fill: lower "
            f"{' or '.join(k for n in later for k in n.keys)}"))
    return Verdict()


def read_host_memory(proc: Path | None = None, cgroup_root: Path | None = None) -> HostMemory:
    """This process's memory cgroup limit and resident memory, and the host's MemAvailable, read
    under `proc` and `cgroup_root` (default `PROC`, `CGROUP_ROOT`). What cannot be read is unknown."""
    proc = PROC if proc is None else proc
    cgroup_root = CGROUP_ROOT if cgroup_root is None else cgroup_root
    limit, where = _cgroup_limit(proc, cgroup_root)
    return HostMemory(limit, where, _kib_field(proc / "self" / "status", "VmRSS") or 0,
                      _kib_field(proc / "meminfo", "MemAvailable"))


def _kib_field(path: Path, name: str) -> int | None:
    """`name:   123 kB` from a /proc file, in bytes."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == name:
            try:
                return int(value.split()[0]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def _cgroup_limit(proc: Path, root: Path) -> tuple[int | None, str]:
    """The memory limit of this process's cgroup, v1 (a `memory` controller line) before v2
    (the `0::` line: in a hybrid set-up v2 holds no memory controller)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, ""
    v1 = v2 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            v1 = parts[2]
        elif parts[0] == "0" and not parts[1]:
            v2 = parts[2]
    if v1 is not None:
        return _least_limit(root / "memory", v1, "memory.limit_in_bytes")
    if v2 is not None:
        return _least_limit(root, v2, "memory.max")
    return None, ""


def _least_limit(mount: Path, path: str, name: str) -> tuple[int | None, str]:
    """The least limit in `name` from the cgroup at `path` up to the mount's root (an ancestor's
    limit binds too). A path not found under the mount (a container without a cgroup namespace
    sees the host's path, its own cgroup mounted as the root) is cut from the front until it is."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    while parts and not mount.joinpath(*parts).is_dir():
        parts = parts[1:]
    least: int | None = None
    where = ""
    while True:
        file = mount.joinpath(*parts, name)
        value = _limit_in(file)
        if value is not None and (least is None or value < least):
            least, where = value, str(file)
        if not parts:
            return least, where
        parts.pop()


def _limit_in(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    try:
        value = int(text)  # "max" (v2): no limit
    except ValueError:
        return None
    return value if 0 <= value < NO_LIMIT_FROM_BYTES else None
