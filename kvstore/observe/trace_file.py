"""The request trace: one JSON line per request (and per read or write of a snapshot), for
evaluating TTL policies offline.

Role: defines `TraceRecord` (what one request looked like to the local pool), writes records as
JSON lines (`TraceWriter`: append-only, flushed per record, safe from many threads), reads them
back as a stream (`read_trace`: a malformed line fails with its line number; a last line cut off
mid-write is skipped), and generates deterministic synthetic traces (`synthetic_trace`) for tests
and `kvstore tune ttl --synthetic`.

A line holds no token contents and no keys: only time, tenant, an opaque session id, the prefix
length and the local-state outcome, optionally the snapshot size and replay length:

    {"time": 1712.5, "tenant": "acme", "session": "s-42", "prefix_tokens": 8192,
     "local_outcome": "hit", "snapshot_bytes": 1351680, "replay_tokens": 128}

`local_outcome`: "hit" (local snapshot found), "expired" (global hit, snapshot expired, not
replayed), "replayed" (global hit, snapshot missing, rebuilt by replay), "absent" (global hit, no
snapshot was ever written for it), "cold" (global miss: a full prefill; local state irrelevant).
A Lookup that was not an engine's request (a client's pre-check before a Store, a probe) is
written with `"purpose": "precheck"` or `"probe"`, so a reader can count it apart; `kvstore tune
ttl` leaves such lines out of the evaluation. Unknown keys are ignored so that later versions can
add fields. An optional `"model"` names the model the request was for: `kvstore tune ttl` then
keys snapshots by model too (the pool keeps each model's apart), where a line without it counts as
one shared model.

An optional `"method"` says which call wrote the line: "lookup" or "resume" (a request; the pool
only peeks on a Lookup, so a Lookup's hit restarts no sliding TTL, a Resume's does), or
"load_local": no request, but a LoadLocal that got the snapshot its session's request had just
found (the engine's hybrid path: Lookup, Load, LoadLocal), a read that restarts a sliding TTL. Such
a line has `"local_outcome": "hit"` and `"prefix_tokens": 0` (the read sends no prompt: the snapshot
it read is the one its session's request before it resumed from). "store_local": no request either,
but a StoreLocal that wrote a snapshot (after the engine's decode: the pool's TTL runs from then),
with `"local_outcome": "hit"` (held from then on), `"prefix_tokens": 0` and its `snapshot_bytes`, in
the session the next request at its boundary gets. A line without `method` (an older trace) is a
request whose hit counts as a read; a trace without "store_local" lines is one written before
writes were traced (`kvstore tune ttl` then takes each request to write at its own time).

What it does not know: the service, the pool, or how records are evaluated (kvstore.observe.ttl_tuning).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, get_args

import numpy as np

from kvstore.config.files import open_stream
from kvstore.errors import InvalidInput, StorageError
from kvstore.wire.purposes import PURPOSES

log = logging.getLogger(__name__)

LocalOutcome = Literal["hit", "expired", "absent", "replayed", "cold"]
LOCAL_OUTCOMES: tuple[str, ...] = get_args(LocalOutcome)
TraceMethod = Literal["lookup", "resume", "load_local", "store_local"]
TRACE_METHODS: tuple[str, ...] = get_args(TraceMethod)
# JSON integers are unbounded; past this one a float (or numpy's int64 sums) no longer holds them.
MAX_INT = 2**53
# A line's time, in seconds, lies within +-this (epoch seconds until the year 5138): a float's
# spacing there is ~15 µs. Epoch milli- or nanoseconds lie past it, where spacing coarser than a
# TTL's millisecond makes `t + ttl == t` and the evaluation meaningless (or endless).
MAX_TIME_SECONDS = 1e11
# A line is a few hundred bytes; a longer one (with its newline) is refused, not read whole.
MAX_LINE_BYTES = 1 << 20
# A power cut mid-append may leave a file's end as zero bytes (ext4's and xfs's delayed allocation:
# the size reached the disk, the data did not); they are looked for this far back from the end.
MAX_ZERO_TAIL_BYTES = 256 << 20
# A file of zero bytes only, up to this size, is a new trace a crash left empty; larger, not a trace.
MAX_ZERO_ONLY_BYTES = 1 << 20
# What a blank line holds: whitespace, or the zero bytes a crash left.
_BLANK = b" \t\n\r\x0b\x0c\0"


@dataclass(frozen=True, slots=True)
class TraceRecord:
    time: float  # seconds; any origin, but one clock for the whole trace
    tenant: str
    session: str  # opaque; sessions are told apart by (tenant, session)
    prefix_tokens: int  # prompt tokens of the request (the part that can be cached)
    local_outcome: LocalOutcome
    snapshot_bytes: int | None = None  # bytes of the local snapshot this request would write
    replay_tokens: int | None = None  # tokens a replay of this request's boundary runs
    purpose: str = ""  # "precheck" | "probe": not an engine request (kvstore/wire/purposes.py)
    model: str = ""  # the model the request was for ("": not recorded)
    # "lookup" | "resume": the request's call; "load_local": a read of a snapshot, not a request;
    # "store_local": a write of one, not a request; "": not recorded (an older trace: a request
    # whose hit counts as a read)
    method: str = ""

    @property
    def is_read(self) -> bool:
        """A LoadLocal's read of a snapshot: no request."""
        return self.method == "load_local"

    @property
    def is_write(self) -> bool:
        """A StoreLocal's write of a snapshot: no request."""
        return self.method == "store_local"

    def to_json(self) -> str:
        obj: dict[str, object] = {
            "time": self.time, "tenant": self.tenant, "session": self.session,
            "prefix_tokens": self.prefix_tokens, "local_outcome": self.local_outcome,
        }
        if self.snapshot_bytes is not None:
            obj["snapshot_bytes"] = self.snapshot_bytes
        if self.replay_tokens is not None:
            obj["replay_tokens"] = self.replay_tokens
        if self.purpose:
            obj["purpose"] = self.purpose
        if self.model:
            obj["model"] = self.model
        if self.method:
            obj["method"] = self.method
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    @staticmethod
    def from_mapping(obj: Mapping[str, object]) -> TraceRecord:
        """Validate one decoded line; raises InvalidInput naming the bad field."""
        time = obj.get("time")
        if isinstance(time, bool) or not isinstance(time, int | float) or not _finite(time):
            raise InvalidInput(f"'time' must be a finite number of seconds, got {_shown(time)}")
        if not -MAX_TIME_SECONDS <= time <= MAX_TIME_SECONDS:
            raise InvalidInput(f"'time' must be seconds within +-{MAX_TIME_SECONDS:.0e} (epoch seconds, not milli- or "
                               f"nanoseconds), got {_shown(time)}")
        tenant, session = obj.get("tenant"), obj.get("session")
        if not isinstance(tenant, str):
            raise InvalidInput(f"'tenant' must be a string, got {tenant!r}")
        if not isinstance(session, str):
            raise InvalidInput(f"'session' must be a string, got {session!r}")
        outcome = obj.get("local_outcome")
        if outcome not in LOCAL_OUTCOMES:
            raise InvalidInput(f"'local_outcome' must be one of {', '.join(LOCAL_OUTCOMES)}, got {outcome!r}")
        prefix = _count(obj, "prefix_tokens", required=True)
        assert prefix is not None
        purpose = obj.get("purpose", "")
        if purpose not in ("", *PURPOSES):
            raise InvalidInput(f"'purpose' must be one of {', '.join(PURPOSES)} when present, got {purpose!r}")
        model = obj.get("model", "")
        if not isinstance(model, str):
            raise InvalidInput(f"'model' must be a string when present, got {_shown(model)}")
        method = obj.get("method", "")
        if method not in ("", *TRACE_METHODS):
            raise InvalidInput(f"'method' must be one of {', '.join(TRACE_METHODS)} when present, got {_shown(method)}")
        return TraceRecord(
            float(time), tenant, session, prefix, outcome,  # type: ignore[arg-type]
            _count(obj, "snapshot_bytes", required=False), _count(obj, "replay_tokens", required=False),
            str(purpose), model, str(method),
        )


def _finite(x: int | float) -> bool:
    # math.isfinite() of an int too large for a float raises OverflowError.
    return abs(x) < MAX_INT if isinstance(x, int) else math.isfinite(x)


def _shown(v: object) -> str:
    """`repr(v)`, cut short: a bad value may be a number thousands of digits long."""
    r = repr(v)
    return r if len(r) <= 40 else f"{r[:24]}... ({len(r)} characters)"


def _count(obj: Mapping[str, object], name: str, required: bool) -> int | None:
    v = obj.get(name)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < MAX_INT:
        raise InvalidInput(f"'{name}' must be an integer >= 0 and < 2**53, got {_shown(v)}")
    return v


class TraceWriter:
    """Appends records to a JSON-lines file (`truncate`: start it afresh). Each record is one
    `write` of one whole line, under a lock, then flushed: a crash loses at most the line being
    written, and lines never interleave. Appending to a file whose last line was cut off (a crash
    mid-write) first drops that piece of a line, so the file stays readable to its end; a whole
    last line that only lacks its newline (written by hand) gets one.

    A regular file is watched, at most once every `check_seconds`: once its path names another
    file or none (an operator's `mv`, logrotate), the path is opened again (created with the old
    file's mode), so that lines never go on into a moved file. With `max_bytes` (0: no cap), a line
    that would take the file past it first moves the file to `<path>.1` (replacing an older one)
    and begins a new one. Both happen between lines: a line is never split across two files."""

    def __init__(self, path: str | os.PathLike[str], truncate: bool = False, *, max_bytes: int = 0,
                 check_seconds: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        assert max_bytes >= 0 and check_seconds >= 0
        self._path = Path(path)
        try:
            if not truncate:
                _drop_cut_off_line(self._path)
            mode = "w" if truncate else "a"
            self._file: IO[str] = self._path.open(mode, encoding="utf-8", newline="\n")
        except OSError as e:
            raise StorageError(f"cannot open trace file {self._path}: {e.strerror}") from None
        self._lock = threading.Lock()
        self._max_bytes = max_bytes
        self._check_seconds = check_seconds
        self._clock = clock
        st = os.fstat(self._file.fileno())
        # A pipe or a device (/dev/stdout) is never moved or capped: there is no file to rotate.
        self._regular = stat.S_ISREG(st.st_mode)
        self._size = st.st_size
        self._checked_at = clock()
        self._rotate_after = -math.inf  # after a failed move: not tried again before this
        self._reopen_failed = self._rotate_failed = False  # each said once, until it succeeds

    def write(self, record: TraceRecord) -> None:
        line = record.to_json() + "\n"
        with self._lock:
            self._write_line(line)
            self._file.flush()

    def write_many(self, records: Iterable[TraceRecord]) -> int:
        """Append many records with one flush at the end (for saving generated traces)."""
        n = 0
        with self._lock:
            for r in records:
                self._write_line(r.to_json() + "\n")
                n += 1
            self._file.flush()
        return n

    def _write_line(self, line: str) -> None:
        """One whole line into the file the path names now (under the lock)."""
        if self._regular:
            nbytes = len(line.encode("utf-8"))
            now = self._clock()
            if now - self._checked_at >= self._check_seconds:
                self._checked_at = now
                self._follow_path()
            if (self._max_bytes and self._size > 0 and self._size + nbytes > self._max_bytes
                    and now >= self._rotate_after):
                self._rotate(now)
            self._size += nbytes
        self._file.write(line)

    def _follow_path(self) -> None:
        """Reopen the path when it no longer names the file held (moved or removed)."""
        self._file.flush()
        held = os.fstat(self._file.fileno())
        try:
            now = os.stat(self._path)
        except FileNotFoundError:
            now = None
        except OSError:
            return  # not knowable now (a directory gone unreadable): keep writing where we are
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            self._size = held.st_size  # truncated by someone (logrotate's copytruncate): follow it
            return
        self._reopen(stat.S_IMODE(held.st_mode), f"{self._path} was moved or removed")

    def _rotate(self, now: float) -> None:
        """Move the full file to `<path>.1` and begin a new one."""
        self._file.flush()
        held = os.fstat(self._file.fileno())
        mode = stat.S_IMODE(held.st_mode)
        old = self._path.with_name(self._path.name + ".1")
        error: OSError | None = None
        try:
            at = os.stat(self._path)
        except FileNotFoundError:  # moved or removed since the last look: begin anew, nothing to move
            self._reopen(mode, f"{self._path} was moved or removed")
            return
        except OSError as e:
            at, error = None, e
        if at is not None and (at.st_dev, at.st_ino) != (held.st_dev, held.st_ino):
            self._reopen(mode, f"{self._path} was replaced")  # someone else's file now: never moved
            return
        if at is not None:
            try:
                os.replace(self._path, old)
            except OSError as e:
                error = e
            else:
                log.info("trace %s reached trace.max_bytes (%d): moved to %s, a new file begun", self._path,
                         self._max_bytes, old)
                self._reopen(mode, "")
                return
        # Tried again a check interval later, not at every line; said once.
        self._rotate_after = now + self._check_seconds
        if not self._rotate_failed:
            log.warning("trace %s reached trace.max_bytes (%d) but cannot be moved to %s (%s); writing on",
                        self._path, self._max_bytes, old, (error and error.strerror) or error)
            self._rotate_failed = True

    def _reopen(self, mode: int, why: str) -> None:
        """Open the path afresh (created with `mode`; one that exists again, e.g. logrotate's
        `create`, is appended to as found); on failure keep the file held and say so once."""
        try:
            created = True
            try:
                fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            except FileExistsError:
                _drop_cut_off_line(self._path)  # refuses a file that is no trace (StorageError)
                fd, created = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC), False
            try:
                if created:
                    os.fchmod(fd, mode)  # the old file's mode, whatever the umask
                new = os.fdopen(fd, "a", encoding="utf-8", newline="\n")
            except BaseException:
                os.close(fd)
                raise
        except (OSError, StorageError) as e:
            if not self._reopen_failed:
                log.warning("trace: cannot open %s again (%s); lines go on into the file held until it can be",
                            self._path, getattr(e, "strerror", None) or e)
                self._reopen_failed = True
            self._rotate_after = self._clock() + self._check_seconds  # a cap reached: not at every line
            return
        old, self._file = self._file, new
        old.close()
        st = os.fstat(fd)
        self._regular, self._size = stat.S_ISREG(st.st_mode), st.st_size
        self._reopen_failed = self._rotate_failed = False
        if why:
            log.info("trace: %s; writing to a new %s", why, self._path)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _sweep_stale_temps(target: Path) -> None:
    """Remove the temporary files an earlier `save_trace` to `target` left when it was killed
    (SIGKILL runs no clean-up): those whose writer's pid no longer runs."""
    for tmp in target.parent.glob(f".{glob.escape(target.name)}.*-*.tmp"):
        pid = tmp.name[len(target.name) + 2:].split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or no pid at all: left alone
    return True


def save_trace(path: str | os.PathLike[str], records: Iterable[TraceRecord]) -> int:
    """`write_whole_trace`, a failed write a StorageError (`tune --save-trace`)."""
    try:
        return write_whole_trace(path, records)
    except OSError as e:
        raise StorageError(f"cannot write trace {path}: {e.strerror or e}") from None


def write_whole_trace(path: str | os.PathLike[str], records: Iterable[TraceRecord]) -> int:
    """Write `records` as a new trace at `path` (replacing any file there), all or nothing: into a
    temporary file beside it, renamed over `path` once whole, so that a run stopped part-way (a
    SIGTERM, a full disk) leaves no shorter trace that reads as complete. A path that exists and is
    not a regular file (a pipe, /dev/stdout) is written directly. A failed write raises its OSError."""
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        with TraceWriter(target, truncate=True) as w:
            return w.write_many(records)
    _sweep_stale_temps(target)
    tmp = target.parent / f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)  # as open(): umask applies
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            n = 0
            for r in records:
                f.write(r.to_json() + "\n")
                n += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return n


def check_trace_file(path: str | os.PathLike[str]) -> None:
    """Whether `path` may be appended to as a trace: a StorageError saying it is "not a kvstore
    trace file" where it is a regular file whose first and last whole lines are not JSON objects, or
    whose cut-off tail (less the zero bytes a crash may leave) is no piece of one (a gzip or tar
    archive of an old trace, a log), so that no other file is cut back or written into. A missing or
    empty file passes, and so does one that is not regular (never read: a pipe or a device)."""
    p = Path(path)
    if not p.is_file() or p.stat().st_size == 0:
        return
    with p.open("rb") as f:
        at, data_end, _ = _layout(f)
        _check_looks_like_a_trace(f, p, at, data_end)


def _layout(f: IO[bytes], block: int = 1 << 16) -> tuple[int, int, int]:
    """Where the piece after the last newline starts, where the data ends (before the zero bytes a
    crash left, if any) and where the file ends."""
    end = f.seek(0, os.SEEK_END)
    data_end = _end_of_data(f, end, max(block, 1 << 16))
    return _tail_of(f, data_end, block), data_end, end


def _end_of_data(f: IO[bytes], end: int, block: int) -> int:
    """Where the zero bytes that end the file start (`end`: none); past MAX_ZERO_TAIL_BYTES of them
    the search stops, and the rest is judged as data (no trace)."""
    def data_ends(piece: bytes) -> int:
        return len(piece.rstrip(b"\0")) or -1

    return _scan_back(f, end, block, MAX_ZERO_TAIL_BYTES, data_ends, gave_up=None)


def _tail_of(f: IO[bytes], end: int, block: int) -> int:
    """Where the part of the file before `end` after its last newline starts; the search stops once
    that part is longer than a line may be (no trace: a binary file)."""
    def after_newline(piece: bytes) -> int:
        return piece.rfind(b"\n") + 1 or -1

    return _scan_back(f, end, block, MAX_LINE_BYTES + 1, after_newline, gave_up=0)


def _scan_back(f: IO[bytes], end: int, block: int, most: int, found: Callable[[bytes], int],
               gave_up: int | None) -> int:
    """Read back from `end` a block at a time, at most `most` bytes, until `found(block)` gives the
    offset in it that ends the search (-1: read on); not found, `gave_up` (None: where the reading
    stopped, the file's start or the bound)."""
    at = end
    while at > 0 and end - at < most:
        start = max(0, at - block)
        f.seek(start)
        offset = found(f.read(at - start))
        if offset >= 0:
            return start + offset
        at = start
    return at if gave_up is None else gave_up


def _check_looks_like_a_trace(f: IO[bytes], p: Path, at: int, end: int) -> None:
    """Judged on whole lines (a line of zero bytes is blank) and the piece from `at` to `end`, the
    data's end: a crash's zero bytes after it are no evidence either way, but a file of nothing
    else, larger than a crash leaves of a new trace, is no trace (a disk image, a swap file)."""
    if end == 0 and (size := f.seek(0, os.SEEK_END)) > MAX_ZERO_ONLY_BYTES:
        raise StorageError(f"{p} is not a kvstore trace file ({size} bytes, all zero: a disk image or a swap file?): "
                           "it is left as it is; name a new file or an existing trace")
    f.seek(0)
    first = f.readline(MAX_LINE_BYTES + 1) if at > 0 else b""
    f.seek(max(0, at - MAX_LINE_BYTES - 1))
    before = f.read(at - f.tell()).split(b"\n")[:-1]  # the whole lines just before the tail
    if at > MAX_LINE_BYTES + 1:
        before = before[1:]  # the first piece may start mid-line
    last = next((line for line in reversed(before) if line.strip(_BLANK)), b"")
    tail = f.read(min(end - at, MAX_LINE_BYTES + 1))  # a piece of a line: no longer than one
    whole = [line for line in (first, last) if line.strip(_BLANK)]
    tail_ok = len(tail) <= MAX_LINE_BYTES and (
        not tail.strip() or _json_object(tail) or tail.lstrip().startswith(b"{"))
    if not tail_ok or not all(_json_object(line) for line in whole):
        raise StorageError(f"{p} is not a kvstore trace file (its lines are not JSON objects): it is left as it "
                           "is; name a new file or an existing trace")


def _json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, RecursionError):
        return False


def _drop_cut_off_line(path: Path, block: int = 1 << 16) -> None:
    """Cut a trace file back to its last newline when what follows it is not a JSON object: a line
    a crash cut off, or zero bytes a power cut left in place of the last lines (a pipe or a device
    is never read). A file that does not look like a trace is refused (`check_trace_file`), never
    cut."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("r+b") as f:
        at, data_end, end = _layout(f, block)
        _check_looks_like_a_trace(f, path, at, data_end)
        if at == end:
            return
        f.seek(at)
        piece = f.read(data_end - at)  # within a line's length: checked just now
        zeros = "zero bytes a crash left (their data never reached the disk)"
        if _json_object(piece):  # a whole last line that lacks only its newline
            if data_end < end:
                log.warning("%s: dropping the last %d bytes, %s", path, end - data_end, zeros)
            f.truncate(data_end)
            f.seek(data_end)
            f.write(b"\n")
            return
        what = ("a line cut off mid-write" if data_end == end else zeros if at == data_end
                else f"a line cut off mid-write, then {zeros}")
        log.warning("%s: dropping the last %d bytes, %s", path, end - at, what)
        f.truncate(at)


def read_trace(path: str | os.PathLike[str]) -> Iterator[TraceRecord]:
    """Stream the records of a trace file. The file is opened now (a missing file fails here);
    a malformed line fails, when reached, with InvalidInput naming the file and line. Blank lines
    are skipped, and so is (with a logged warning) a last line that has no newline and is not
    JSON: one cut off by a crash mid-write, as are the zero bytes a power cut may leave. A FIFO or a
    device is read too (`zcat trace.gz | kvstore tune ttl --trace /dev/stdin`), once it sends its
    first byte (`open_stream`: a FIFO nothing writes to fails in seconds)."""
    p = Path(path)
    try:
        f = open_stream(p)
    except OSError as e:
        raise InvalidInput(f"cannot read trace {p}: {e.strerror}") from None
    except ValueError:  # a NUL in the name
        raise InvalidInput(f"cannot read trace {str(p)!r}: a file name cannot contain a NUL") from None
    return _records(f, p)


def _records(f: IO[bytes], p: Path) -> Iterator[TraceRecord]:
    zeros, zeros_at = 0, 0  # a run of zero bytes (a power cut's) and its first line: skipped, within a bound
    cut: tuple[int, str] | None = None  # a line without its newline that is no JSON: cut off, if only zeros follow
    with f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if not raw.strip(_BLANK):
                zeros_at = zeros_at or (lineno if b"\0" in raw else 0)
                zeros += raw.count(0)
                if zeros > MAX_ZERO_TAIL_BYTES:  # /dev/zero, or a disk image: no trace
                    raise InvalidInput(f"{p}:{zeros_at}: not a trace record (more than {MAX_ZERO_TAIL_BYTES:,} "
                                       "zero bytes)")
                continue
            if cut is not None:  # not the last line after all: no crash cut it off
                raise InvalidInput(f"{p}:{cut[0]}: not a JSON line ({cut[1]})")
            if zeros:
                log.warning("%s:%d: skipping %d zero bytes a crash left", p, zeros_at, zeros)
                zeros, zeros_at = 0, 0
            # Only a line read to no newline (the last, or one past the bound) may end in a power cut's zeros.
            body = raw if raw.endswith(b"\n") else raw.rstrip(b"\0")
            if len(body) > MAX_LINE_BYTES:
                raise InvalidInput(f"{p}:{lineno}: not a trace record (a line longer than {MAX_LINE_BYTES:,} bytes)")
            try:
                obj = json.loads(body)  # bytes: decoded as UTF-8; a bad byte is a ValueError too
            except RecursionError:
                raise InvalidInput(f"{p}:{lineno}: not a trace record (nested too deeply)") from None
            except ValueError as e:
                if not raw.endswith(b"\n"):  # the last line, unless more than zeros follow: cut off by a crash
                    cut = (lineno, _reason(e))
                    continue
                raise InvalidInput(f"{p}:{lineno}: not a JSON line ({_reason(e)})") from None
            if not isinstance(obj, dict):
                raise InvalidInput(f"{p}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            try:
                yield TraceRecord.from_mapping(obj)
            except InvalidInput as e:
                raise InvalidInput(f"{p}:{lineno}: {e}") from None
    if cut is not None:
        log.warning("%s:%d: skipping the last line: cut off mid-write (%s)", p, *cut)
    if zeros:
        log.warning("%s:%d: skipping %d zero bytes a crash left", p, zeros_at, zeros)


def _reason(e: ValueError) -> str:
    return e.msg if isinstance(e, json.JSONDecodeError) else str(e)


# --- synthetic traces ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticTraceSpec:
    """Sessions arrive as a Poisson process; each has a geometric number of turns. Gaps between
    turns mix short in-session gaps (think and tool time, exponential) with long returns after a
    break (log-normal). Some requests are retries of the previous prompt (same boundary)."""

    tenants: tuple[str, ...] = ("tenant-a", "tenant-b")
    sessions_per_second: float = 0.2
    mean_turns: float = 12.0
    short_gap_mean_seconds: float = 20.0
    long_gap_probability: float = 0.15
    long_gap_median_seconds: float = 1800.0
    long_gap_sigma: float = 1.0  # of log(gap)
    retry_probability: float = 0.05
    retry_gap_mean_seconds: float = 3.0
    first_prefix_tokens: int = 4096
    turn_tokens_mean: float = 700.0
    cold_probability: float = 0.02  # a return whose global KV was gone (recorded as cold)
    recorded_ttl_seconds: float = 300.0  # outcomes are recorded as if under this sliding TTL
    snapshot_bytes: int = 1_351_680
    replay_tokens: int = 128


def synthetic_trace(
    n_requests: int, seed: int = 0, spec: SyntheticTraceSpec | None = None
) -> list[TraceRecord]:
    """`n_requests` records in time order, the same for the same seed and spec."""
    if n_requests < 0:
        raise InvalidInput(f"a synthetic trace needs n_requests >= 0, got {n_requests}")
    s = spec or SyntheticTraceSpec()
    rng = np.random.default_rng(seed)
    if n_requests == 0:
        return []
    # Turns per session, until they add up to n_requests (the last session is cut short).
    turns = rng.geometric(1.0 / max(s.mean_turns, 1.0), size=int(n_requests / max(s.mean_turns, 1.0)) + 16)
    while int(turns.sum()) < n_requests:
        turns = np.concatenate([turns, rng.geometric(1.0 / max(s.mean_turns, 1.0), size=len(turns))])
    ends = np.cumsum(turns)
    n_sessions = int(np.searchsorted(ends, n_requests)) + 1
    turns = turns[:n_sessions].copy()
    turns[-1] -= int(ends[n_sessions - 1]) - n_requests
    session_of = np.repeat(np.arange(n_sessions), turns)  # [n]
    first = np.ones(n_requests, dtype=bool)
    first[1:] = session_of[1:] != session_of[:-1]

    starts = np.cumsum(rng.exponential(1.0 / s.sessions_per_second, size=n_sessions))  # [sessions]
    is_long = rng.random(n_requests) < s.long_gap_probability
    is_retry = ~first & (rng.random(n_requests) < s.retry_probability)
    gap = np.where(
        is_long,
        rng.lognormal(math.log(s.long_gap_median_seconds), s.long_gap_sigma, size=n_requests),
        rng.exponential(s.short_gap_mean_seconds, size=n_requests),
    )
    gap = np.where(is_retry, rng.exponential(s.retry_gap_mean_seconds, size=n_requests), gap)
    gap = np.round(np.where(first, 0.0, gap), 3)  # [n] milliseconds are plenty
    turn_tokens = 1 + rng.exponential(s.turn_tokens_mean, size=n_requests).astype(np.int64)
    grow = np.where(is_retry | first, 0, turn_tokens)  # [n] tokens added by each request
    session_start_idx = np.flatnonzero(first)
    time = starts[session_of] + _segment_cumsum(gap, session_start_idx)
    prefix = s.first_prefix_tokens + _segment_cumsum(grow, session_start_idx).astype(np.int64)
    cold = first | (rng.random(n_requests) < s.cold_probability)
    hit = ~cold & (gap <= s.recorded_ttl_seconds)
    tenant_of = rng.integers(0, len(s.tenants), size=n_sessions)[session_of]

    order = np.argsort(time, kind="stable")
    records = []
    for i in order.tolist():
        outcome: LocalOutcome = "cold" if cold[i] else ("hit" if hit[i] else "replayed")
        records.append(TraceRecord(
            round(float(time[i]), 3), s.tenants[int(tenant_of[i])], f"s{int(session_of[i]):07d}",
            int(prefix[i]), outcome, s.snapshot_bytes, s.replay_tokens,
        ))
    return records


def _segment_cumsum(x: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Cumulative sum of `x` restarting at each index in `starts` (which includes 0)."""
    c = np.cumsum(x)
    offset = np.zeros_like(c)
    offset[starts[1:]] = c[starts[1:] - 1]
    return c - np.maximum.accumulate(offset)
